"""``kvtier top``'s one deadline: with ``--once`` or ``--json`` the whole command ends within
``--timeout`` (besides its ``--interval``), and in the live view each refresh does, however
many endpoints answer slowly and however large a page is; what was cut short is one line."""

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest

from kvtier.cli.deadline import Deadline, DeadlineExpired
from kvtier.cli.stats import parse_samples
from kvtier.cli.top_figures import figures
from kvtier.cli.top_scrape import Scrape
from tests.helpers.metrics import Handler, serving

ROOT = Path(__file__).resolve().parents[1]
KVTIER = [sys.executable, "-m", "kvtier.cli.main", "top"]
WAIT_S = 60  # bound of every wait for a process
PAGE = b"""kvtier_chunks_loaded_total{tier="host"} 3
kvtier_chunks_loaded_total{tier="disk"} 5
kvtier_chunks_missed_total 2
kvtier_slots{tier="host"} 8
kvtier_slots{tier="disk"} 64
kvtier_used_slots{tier="host"} 2
kvtier_used_slots{tier="disk"} 16
kvtier_io_queue_depth 0
"""


def dripping(whole: int, drip_s: float, page: bytes = PAGE) -> type[Handler]:
    """An endpoint that answers its first ``whole`` reads at once, then sends each page in
    ten pieces over ``drip_s`` seconds: every piece well inside ``--timeout``."""
    served = iter(range(10**9))

    class Drip(Handler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Length", str(len(page)))
            self.end_headers()
            step = len(page) if next(served) < whole else -(-len(page) // 10)
            with contextlib.suppress(OSError):
                for start in range(0, len(page), step):
                    time.sleep(0 if step == len(page) else drip_s / 10)
                    self.wfile.write(page[start:start + step])
                    self.wfile.flush()
    return Drip


@contextmanager
def endpoints(count: int, whole: int, drip_s: float) -> Iterator[list[str]]:
    with ExitStack() as stack:
        yield [f"http://{stack.enter_context(serving(dripping(whole, drip_s)))}/metrics"
               for _ in range(count)]


def env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvtier: top: "), err
    return lines[0]


@pytest.mark.parametrize("mode", ["--once", "--json"])
def test_once_ends_within_its_timeout_however_many_endpoints_trickle(mode):
    """Three endpoints each take 1.5 s to send their page: every read is inside --timeout 2,
    the six of one view are not (when each read had its own timeout, this took 9 s and
    printed a view)."""
    with endpoints(3, whole=0, drip_s=1.5) as urls:
        started = time.monotonic()
        done = subprocess.run([*KVTIER, *urls, mode, "--interval", "0.1", "--timeout", "2"],
                              capture_output=True, text=True, env=env(), cwd=ROOT,
                              timeout=WAIT_S)
        took = time.monotonic() - started
    assert done.returncode == 1 and done.stdout == "", done.stderr
    line = one_line(done.stderr)
    assert line.startswith("kvtier: top: cannot read http://127.0.0.1:"), line
    assert "--timeout 2 s ran out" in line and "give a longer --timeout" in line, line
    assert any(url in line for url in urls), line
    assert took < 2 + 0.1 + 6, took  # the timeout, the interval, starting Python


def test_each_refresh_of_the_live_view_ends_within_its_timeout():
    """Two endpoints answer their first read at once, then take 1.5 s for each: a refresh
    of both is past --timeout 2, one read is not (when each read had its own timeout, the
    view went on refreshing every 3 s)."""
    with endpoints(2, whole=1, drip_s=1.5) as urls:
        process = subprocess.Popen([*KVTIER, *urls, "--interval", "0.2", "--timeout", "2"],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                   env=env(), cwd=ROOT)
        started = time.monotonic()
        try:
            out, err = process.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            pytest.fail("the live view went on past a refresh longer than --timeout")
        finally:
            process.kill()
            process.wait(WAIT_S)
        took = time.monotonic() - started
    assert process.returncode == 1, err
    line = one_line(err)
    assert line.startswith("kvtier: top: lost http://"), err
    assert "--timeout 2 s ran out" in line and "Traceback" not in err, err
    assert "kvtier top" in out  # the first view was shown
    assert took < 0.2 + 2 + 8, took  # the interval, one refresh, starting and the first view


def test_a_page_of_more_tiers_than_kvtier_has_is_refused_not_laid_out():
    """rich takes seconds to lay out thousands of rows, past any --timeout: a page with more
    tiers than a kvtier endpoint has is no kvtier endpoint's."""
    page = "".join(f'kvtier_slots{{tier="t{i}"}} 1\n' for i in range(5000)).encode()
    with serving(dripping(10**9, 0.0, page)) as address:
        done = subprocess.run([*KVTIER, address, "--once", "--interval", "0.1"],
                              capture_output=True, text=True, env=env(), cwd=ROOT,
                              timeout=WAIT_S)
    assert done.returncode == 1 and done.stdout == "", done.stderr
    assert "5,000 tiers, more than 64" in one_line(done.stderr)


def test_indexing_a_page_and_working_out_its_figures_stop_at_the_deadline():
    samples = [{"name": "kvtier_slots", "labels": {"tier": "host", "rank": str(i)}, "value": 1.0}
               for i in range(5000)]  # two looks while reading them, one while indexing
    looks = iter([0.0, 0.0, 10.0])  # reading them in time, indexing them past it
    with pytest.raises(DeadlineExpired, match=r"--timeout 5 s ran out while indexing the "
                                              r"page \(4,096 of 5,000 samples\)"):
        Scrape.of("u", 0.0, samples, Deadline(5.0, 5.0, lambda: next(looks)))
    after = Scrape.of("u", 1.0, parse_samples(PAGE))
    with pytest.raises(DeadlineExpired, match=r"ran out while working out the figures of u "
                                              r"\(tier 1 of 2\)"):
        figures(None, after, Deadline(5.0, 5.0, lambda: 10.0))
