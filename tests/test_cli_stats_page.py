"""``kvtier stats`` on a large page (issue 40, finding 5): its cost is in proportion to the
samples (each line matched once, prometheus_client's slow parser only for pages outside the
common grammar, and every page read as that parser reads it), a page past the table's size
printed one line a sample, and ``--timeout`` bounding the whole command: on expiry it says
what it did, on one line, exit 1. Figures: scripts/bench_stats.py."""

import itertools
import math
import os
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from kvtier.cli import metrics_text, stats
from kvtier.cli.deadline import Deadline, DeadlineExpired
from kvtier.cli.main import app
from kvtier.cli.stats_render import BATCH, TABLE_ROWS, print_samples
from tests.helpers.cli import refused
from tests.helpers.metrics import Handler, serving


def kvtier(*args):
    clean = {k: None for k in os.environ if k.startswith("KVTIER_")}
    return CliRunner().invoke(app, [str(a) for a in args], env=clean)


def page(body: bytes):
    """A metrics endpoint serving ``body``."""
    class Page(Handler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
    return serving(Page)


def many(n: int) -> bytes:
    """A page of ``n`` samples as an endpoint writes it."""
    lines = ["# HELP kvtier_chunks_loaded_total chunks loaded",
             "# TYPE kvtier_chunks_loaded_total counter"]
    lines += [f'kvtier_chunks_loaded_total{{tier="t{i}",rank="{i % 8}"}} {i}.0' for i in range(n)]
    return ("\n".join(lines) + "\n").encode()


def library(text: str):
    """prometheus_client's reading of ``text`` (the samples, or the error's class)."""
    try:
        return comparable(metrics_text._by_library(text, None))
    except metrics_text.PageError:
        return metrics_text.PageError


def comparable(samples):
    return [(s["name"], s["labels"], repr(s["value"]), type(s["value"])) for s in samples]


# ---- every page reads as prometheus_client reads it ---------------------------------------

# Pieces of lines: what endpoints write, and what only a lax writer would.
NAMES = ["kvtier_slots", "kvtier_x_total", "kvtier_x", "kvtier_x_created", "other_total"]
LAX_NAMES = ["kvtier:odd", "1bad", ""]
LABEL_NAMES = ["tier", "a_b", "_x"]
LAX_LABEL_NAMES = ["__name__", "__r", "a:b", "9"]
LABEL_TEXT = ["a", " ", "\\\\", "\\n", '\\"', ",", "}", "{", "=", "#", "é", "\t", "\u2028"]
LAX_LABEL_TEXT = ["\\", '"', "\\t"]
VALUES = ["1", "1.0", "-2", "+3", "1e3", "NaN", "+Inf", "-Inf", "1.5", "1" * 400]
LAX_VALUES = ["inf", "1_0", "x", "", "0x1", "\u0661"]
TAILS = ["", " 123", " -5"]
LAX_TAILS = [" 1.5", ' # {a="b"} 1', "  ", "\t2", " 1 2"]
COMMENTS = ["# HELP kvtier_slots slots", "# TYPE kvtier_slots gauge", "# TYPE kvtier_x_total counter",
            "# TYPE kvtier_x histogram", "#", "# just words", ""]
LAX_COMMENTS = ["# TYPE kvtier_x counter", "# TYPE kvtier_x", "#  HELP kvtier_x doc",
                "#\tTYPE kvtier_x counter", "# HELP", "#x TYPE kvtier_x counter",
                "# TYPE 1bad gauge", "  "]


@st.composite
def sample_lines(draw, lax: bool):
    def pick(plain, odd):
        return draw(st.sampled_from(plain + odd if lax else plain))

    pairs = [(pick(LABEL_NAMES, LAX_LABEL_NAMES),
              "".join(pick(LABEL_TEXT, LAX_LABEL_TEXT) for _ in range(draw(st.integers(0, 4)))))
             for _ in range(draw(st.integers(0, 3)))]
    quoted = [f'{k}="{v}"' for k, v in pairs]
    labels = pick(["", "{" + ",".join(quoted) + "}", "{" + ",".join(quoted) + ",}"],
                  ["{ " + ", ".join(quoted) + " }"])
    return (f"{pick(NAMES, LAX_NAMES)}{labels}{pick([' '], ['  ', chr(9)])}"
            f"{pick(VALUES, LAX_VALUES)}{pick(TAILS, LAX_TAILS)}")


PAGES = st.lists(st.one_of(sample_lines(lax=False), sample_lines(lax=False),
                           st.sampled_from(COMMENTS)), max_size=6)
LINES = st.one_of(sample_lines(lax=False), sample_lines(lax=True), st.sampled_from(COMMENTS),
                  st.sampled_from(LAX_COMMENTS))


TRICKY = [["# TYPE kvtier_x counter", "kvtier_x 1"], ["kvtier:odd 1", "kvtier_slots 2"],
          ["#\tTYPE kvtier_x counter", "kvtier_x 1"], ["#  TYPE kvtier_x counter", "kvtier_x 1"],
          ['kvtier_slots{tier="a\\"b\\\\c\\nd"} 1'], ['kvtier_slots{tier="a",tier="b"} 1'],
          ["kvtier_slots \u0661"], ["kvtier_x_created 1", "kvtier_x 2 -3"]]


@settings(max_examples=500, deadline=None)
@given(PAGES, st.lists(LINES, max_size=2), st.randoms())
def test_every_page_reads_as_prometheus_client_reads_it(lines, odd, random):
    """Generated pages, and the tricky ones (``TRICKY``) too."""
    for line in odd:  # what only a lax writer would write, anywhere in the page
        lines.insert(random.randrange(len(lines) + 1), line)
    text = "\n".join(lines)
    assert read(text) == library(text)
    assert keyed(text) == library_keyed(text)


@pytest.mark.parametrize("lines", TRICKY)
def test_tricky_pages_read_as_prometheus_client_reads_them(lines):
    text = "\n".join(lines)
    assert read(text) == library(text)
    assert keyed(text) == library_keyed(text)  # kvtier top's reading too


def keyed(text: str):
    """``parse_keyed``'s reading of ``text`` (the samples, or the error's class)."""
    try:
        return [(n, labels, repr(v)) for n, labels, v in metrics_text.parse_keyed(text)]
    except metrics_text.PageError:
        return metrics_text.PageError


def library_keyed(text: str):
    """prometheus_client's reading of ``text`` as ``parse_keyed`` gives it."""
    try:
        samples = metrics_text._by_library(text, None)
    except metrics_text.PageError:
        return metrics_text.PageError
    return [(s["name"], tuple(sorted(s["labels"].items())), repr(float(s["value"])))
            for s in samples]


def read(text: str):
    """``parse_samples``'s reading of ``text`` (the samples, or the error's class)."""
    try:
        return comparable(metrics_text.parse_samples(text))
    except metrics_text.PageError:
        return metrics_text.PageError


def test_a_page_as_endpoints_write_it_is_read_line_by_line(monkeypatch):
    from prometheus_client import generate_latest
    from prometheus_client.core import CollectorRegistry, CounterMetricFamily, GaugeMetricFamily

    class Collector:
        def collect(self):
            counter = CounterMetricFamily("kvtier_chunks_loaded_total", "h", labels=["tier"])
            for tier in ("host", 'di"sk', "a\\b\nc", "[/bold]"):
                counter.add_metric([tier], 3)
            gauge = GaugeMetricFamily("kvtier_slots", "h", labels=["tier"])
            gauge.add_metric(["host"], math.nan)
            gauge.add_metric(["disk"], math.inf)
            yield from (counter, gauge)

    registry = CollectorRegistry()
    registry.register(Collector())
    text = generate_latest(registry).decode()
    expected = library(text)
    monkeypatch.setattr(metrics_text, "_by_library", lambda *_: pytest.fail("slow path taken"))
    assert comparable(metrics_text.parse_samples(text)) == expected and len(expected) == 6


# ---- a large page: printed one line a sample ----------------------------------------------


def test_a_page_past_the_table_size_is_printed_one_line_a_sample():
    n = TABLE_ROWS + 500
    with page(many(n)) as address:
        result = kvtier("stats", address)
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert len(lines) == n + 1 and f"{n:,} samples, one a line" in lines[0]
    assert lines[1:3] == ["chunks_loaded_total  rank=0, tier=t0  0",
                          "chunks_loaded_total  rank=1, tier=t1  1"]
    assert "┃" not in result.stdout  # no table


def test_a_small_page_is_still_a_table():
    with page(many(3)) as address:
        result = kvtier("stats", address)
    assert result.exit_code == 0 and "┃ metric" in result.stdout


def test_a_large_integer_counter_prints_exactly_as_in_json():
    """The text went through a float (123456789012345677877719597056 for
    123456789012345678901234567890: a review)."""
    body = b"kvtier_big_total 123456789012345678901234567890\n"
    with page(body) as address:
        text, as_json = kvtier("stats", address), kvtier("stats", address, "--json")
    assert text.exit_code == 0 and "123456789012345678901234567890" in text.stdout
    assert "123456789012345678901234567890" in as_json.stdout


# ---- --timeout bounds the whole command ------------------------------------------------


def clock(step: float):
    """A monotonic clock that moves ``step`` seconds further at every look."""
    looks = itertools.count()
    return lambda: time.monotonic() + step * next(looks)


def test_timeout_bounds_parsing_a_page_and_says_how_far_it_got(monkeypatch):
    monkeypatch.setattr(stats.Deadline, "after", classmethod(
        lambda cls, seconds: Deadline(seconds, time.monotonic() + seconds, clock(3.0))))
    with page(many(60_000)) as address:
        result = kvtier("stats", address, "--timeout", "30")
    refused(result, 1, f"stats: {address}: read ", "MiB, then --timeout 30 s ran out while "
            "parsing the page (line ", "give a longer --timeout")
    assert result.stdout == ""


def test_timeout_bounds_printing_and_says_how_much_was_printed(capsys):
    samples = metrics_text.parse_samples(many(2 * BATCH + 10).decode())
    looks = iter([0.0, 10.0])  # the first batch in time, the second past it
    with pytest.raises(DeadlineExpired, match=rf"while printing \({BATCH:,} of "
                                               rf"{2 * BATCH + 10:,} samples printed\)"):
        print_samples("u", samples, Deadline(5.0, 5.0, lambda: next(looks)))
    assert len(capsys.readouterr().out.splitlines()) == BATCH + 1


def test_top_reads_an_endpoint_fetch_and_parse_within_its_timeout(monkeypatch):
    from kvtier.cli import top_scrape

    monkeypatch.setattr(top_scrape.Deadline, "after", classmethod(
        lambda cls, seconds: Deadline(seconds, time.monotonic() + seconds, clock(3.0))))
    with page(many(60_000)) as address:
        result = kvtier("top", address, "--once", "--timeout", "30")
    refused(result, 1, f"top: cannot read {address}: --timeout 30 s ran out while parsing "
            "the page (line ")


@pytest.mark.parametrize("command", [["stats"], ["top", "--once"]])
@pytest.mark.parametrize("url", ["http://admin:Sup3rSecret@127.0.0.1:1/metrics",
                                 "admin:Sup3r/Secret@127.0.0.1:1"])
def test_a_metrics_address_with_a_password_is_refused_without_showing_it(command, url):
    result = CliRunner().invoke(app, [*command, url])
    assert result.exit_code != 0 and "user or password" in result.output
    assert "Sup3r" not in result.output
