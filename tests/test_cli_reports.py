"""What ``kvtier inspect | verify | stats | top | config`` print (audit 2 of the CLI, bugs 4,
7, 8, 9, 11 to 15 and 17): figures and statuses as documented, values from a cache, an
endpoint, a store or the environment printed as they are (never read as markup), strict
JSON, and every failure one printable line."""

import fcntl
import json
import os

import pytest
from typer.testing import CliRunner

from kvtier.cli.main import app
from tests.helpers.cli import refused
from tests.helpers.hostile import make_cache
from tests.helpers.metrics import Handler, serving
from tests.helpers.redis_server import RedisServer, needs_redis
from tests.helpers.store import STRIDE


def kvtier(*args, env=None):
    """``kvtier ARGS`` in this process, with ``env`` as the only KVTIER_ variables."""
    clean = {k: None for k in os.environ if k.startswith("KVTIER_")}
    result = CliRunner().invoke(app, [str(a) for a in args], env={**clean, **(env or {})})
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result


def flat(text):
    """``text`` without whitespace: what a table shows, however it wrapped its cells."""
    return "".join(text.split())


def strict_json(text):
    """``text`` parsed as JSON that has no NaN or Infinity (which are not JSON)."""
    def refuse(constant):
        raise AssertionError(f"not JSON: {constant}")
    return json.loads(text, parse_constant=refuse)


def page(body: bytes):
    """A metrics endpoint serving ``body``."""
    class Page(Handler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
    return serving(Page)


# ---- 4: verify --repair counts every slot it changed ------------------------------------


def test_verify_repair_counts_the_slots_it_blanked(tmp_path):
    segment = make_cache(tmp_path / "c", 6)
    other = make_cache(tmp_path / "o", 1, model="another-model")
    slots = segment / "slots-0000.kvt"
    with open(slots, "r+b") as f:  # another namespace's slot where nothing is indexed
        f.seek(10 * STRIDE)
        f.write((other / "slots-0000.kvt").read_bytes()[:STRIDE])
        f.seek(4 * STRIDE + 30)  # and a torn header on an indexed slot
        f.write(b"\x55")
    found = strict_json(kvtier("verify", tmp_path / "c", "--json").stdout)
    writer = found["namespaces"][0]["writers"][0]
    assert writer["foreign"] == [10] and writer["torn"] == [4]
    result = kvtier("verify", tmp_path / "c", "--repair", "--json")
    writer = strict_json(result.stdout)["namespaces"][0]["writers"][0]
    assert result.exit_code == 0 and writer["repaired"] == 2  # slot 10 blanked; slot 4 and its entry
    assert kvtier("verify", tmp_path / "c").exit_code == 0


# ---- 7: values are printed as they are, never read as markup ---------------------------


def test_stats_and_top_print_labels_and_addresses_as_they_are():
    body = (b'kvtier_slots{tier="[/bold]"} 3\nkvtier_used_slots{tier="[/bold]"} 1\n'
            b'kvtier_slots{tier="[bold red]x"} 2\nkvtier_chunks_missed_total 1\n')
    with page(body) as address:
        stats = kvtier("stats", address)
        linked = kvtier("stats", f"http://{address}/metrics?[/x]")
        top = kvtier("top", address, "--once", "--interval", "0.1")
    assert stats.exit_code == 0 and "tier=[/bold]" in flat(stats.stdout)
    assert "tier=[boldred]x" in flat(stats.stdout)
    assert linked.exit_code == 0 and "metrics?[/x]" in flat(linked.stdout)
    assert top.exit_code == 0 and "[/bold]" in flat(top.stdout)
    assert "[boldred]x" in flat(top.stdout)


@pytest.mark.parametrize(("key", "value"), [("model", "[/x]"), ("model", "[bold]secret"),
                                            ("disk_paths", "/tmp/[/x]")])
def test_config_prints_values_as_they_are(key, value):
    result = kvtier("config", env={f"KVTIER_{key.upper()}": value})
    assert result.exit_code == 0, result.output
    (row,) = [line for line in result.stdout.splitlines() if f" {key} " in line]
    assert value in row


# ---- 8, 9, 17: huge and non-finite values, strict JSON, a bounded --timeout -------------


def test_a_sample_too_large_for_a_float_reads_as_infinite():
    with page(b"kvtier_chunks_stored_total " + b"1" * 400 + b"\nkvtier_slots -" + b"9" * 400
              + b"\n") as address:
        table, data = kvtier("stats", address), kvtier("stats", address, "--json")
        top = kvtier("top", address, "--json", "--interval", "0.1")
    assert table.exit_code == 0 and "inf" in table.stdout
    values = [s["value"] for s in strict_json(data.stdout)["samples"]]
    assert data.exit_code == 0 and values == ["+Inf", "-Inf"]
    assert top.exit_code == 0 and strict_json(top.stdout)[0]["url"] == address


def test_json_is_strict_with_nan_and_infinity():
    with page(b'kvtier_io_queue_depth NaN\nkvtier_slots{tier="host"} +Inf\n'
              b'kvtier_used_slots{tier="host"} 1\n') as address:
        stats = kvtier("stats", address, "--json")
        top = kvtier("top", address, "--json", "--interval", "0.1")
    assert [s["value"] for s in strict_json(stats.stdout)["samples"]] == ["NaN", "+Inf", 1]
    (view,) = strict_json(top.stdout)
    assert view["queue_depth"] == "NaN" and view["tiers"][0]["fill"] == 0.0


@pytest.mark.parametrize("timeout", ["1e12", "3601", "inf"])
def test_stats_timeout_is_at_most_an_hour(timeout):
    refused(kvtier("stats", "127.0.0.1:9", "--timeout", timeout), 2, "--timeout", "at most 3600")


# ---- 16: a failure is one printable line -------------------------------------------------


class Garbage(Handler):
    def do_GET(self):
        self.wfile.write(b"\x00\x1b[31m garbage\r\nmore\r\n\r\n")


def test_a_server_answering_control_bytes_is_one_escaped_line():
    with serving(Garbage) as address:
        result = kvtier("stats", address)
    refused(result, 1, "cannot read metrics", "\\x00\\x1b[31m garbage")
    assert "\x00" not in result.stderr and "\x1b" not in result.stderr


def test_a_config_file_that_does_not_parse_is_one_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("a: [1,\n")
    result = kvtier("config", env={"KVTIER_CONFIG": str(bad)})
    refused(result, 2, str(bad), "line 2")


# ---- 11, 12: keys under the prefix that are not kvtier's ---------------------------------


@pytest.fixture
def redis(tmp_path):
    server = RedisServer(tmp_path / "redis").start()
    yield server
    server.stop()


@needs_redis
def test_inspect_url_counts_keys_not_of_kvtiers_form_as_foreign(redis):
    client = redis.client()
    client.set(b"kvtier:" + b"z" * 32 + b":" + b"z" * 32, b"junk")
    client.set(b"kvtier:[/x]" + b"x" * 28 + b":" + b"0123456789abcdef" * 2, b"junk")
    client.rpush(b"kvtier:" + b"0123456789abcdef" * 2 + b":" + b"0123456789abcdef" * 2, b"a")
    result = kvtier("inspect", redis.url, "--json")
    data = strict_json(result.stdout)
    assert result.exit_code == 0 and data["foreign_keys"] == 3 and data["namespaces"] == []
    table = kvtier("inspect", redis.url)
    assert table.exit_code == 0 and "3 keys under the prefix are not kvtier's" in table.stdout


# ---- 13, 14, 15: inspect's and verify's statuses ------------------------------------------


def damage(segment, name, how, outside):
    path = segment / name
    path.unlink()
    if how == "symlink":
        path.symlink_to(outside)
    elif how == "fifo":
        os.mkfifo(path, 0o600)
    elif how == "hard link":
        outside.write_bytes(b"{}")
        os.link(outside, path)
    elif how == "directory":
        path.mkdir()
    else:  # larger than any lease kvtier writes
        path.write_bytes(b" " * 10000)


@pytest.mark.parametrize(("name", "how"), [
    ("lease", "symlink"), ("lease", "hard link"), ("lease", "directory"), ("lease", "huge"),
    ("log.kvt", "fifo"), ("log.kvt", "symlink"), ("lock", "symlink"), ("lock", "fifo")])
def test_inspect_calls_a_segment_unsafe_when_its_lease_log_or_lock_is_not_kvtiers(
        tmp_path, name, how):
    segment = make_cache(tmp_path / "c", 2)
    damage(segment, name, how, tmp_path / "outside")
    result = kvtier("inspect", tmp_path / "c", "--json")
    (ns,) = strict_json(result.stdout)["namespaces"]
    (writer,) = ns["writers"]
    assert result.exit_code == 1 and ns["status"] == writer["status"] == "unsafe"
    assert f"{segment}/{name}" in writer["problem"] and not writer["in_use"]


def test_verify_says_a_segment_held_by_a_process_is_in_use(tmp_path):
    segment = make_cache(tmp_path / "c", 2)
    with open(segment / "lock", "rb") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        result = kvtier("verify", tmp_path / "c", "--json")
    (writer,) = strict_json(result.stdout)["namespaces"][0]["writers"]
    assert result.exit_code == 0 and writer["in_use"] is True and writer["ok"] == 2
    (writer,) = strict_json(kvtier("verify", tmp_path / "c", "--json").stdout)["namespaces"][0][
        "writers"]
    assert writer["in_use"] is False


@pytest.mark.parametrize("command", ["inspect", "verify", "gc --stale", "clear --yes"])
def test_a_linked_cache_root_is_named_as_a_link(tmp_path, command):
    make_cache(tmp_path / "real", 1)
    link = tmp_path / "root-link"
    link.symlink_to(tmp_path / "real")
    result = kvtier(*command.split()[:1], link, *command.split()[1:])
    refused(result, 2, f"{link} is a symlink; kvtier never follows one")
    assert list((tmp_path / "real").glob("*/writers/*/slots-0000.kvt"))


def test_verify_neither_reads_nor_repairs_a_segment_inspect_calls_unsafe(tmp_path):
    segment = make_cache(tmp_path / "c", 3)
    with open(segment / "slots-0000.kvt", "r+b") as f:  # a torn header: repair would blank it
        f.seek(STRIDE + 30)
        f.write(b"\x55")
    before = (segment / "slots-0000.kvt").read_bytes()
    (segment / "log.kvt").unlink()
    os.mkfifo(segment / "log.kvt", 0o600)
    result = kvtier("verify", tmp_path / "c", "--repair", "--json")
    (writer,) = strict_json(result.stdout)["namespaces"][0]["writers"]
    assert result.exit_code == 1 and writer["repaired"] == 0
    assert writer["problem"] == (f"unsafe: {segment}/log.kvt is a FIFO, not a regular file; "
                                 "kvtier never made it")
    assert (segment / "slots-0000.kvt").read_bytes() == before


def test_verify_repair_says_when_it_could_not_restart_the_log(tmp_path, monkeypatch):
    from kvtier.ops import segments

    segment = make_cache(tmp_path / "c", 3)
    with open(segment / "slots-0000.kvt", "r+b") as f:
        f.seek(STRIDE + 30)
        f.write(b"\x55")
    real = segments._entry_problem  # the log turns into a FIFO between the checks and the repair
    calls = []

    def entry_problem(directory, name):
        calls.append(name)
        return "log.kvt is a FIFO" if name == "log.kvt" and calls.count(name) > 1 else \
            real(directory, name)
    monkeypatch.setattr(segments, "_entry_problem", entry_problem)
    result = kvtier("verify", tmp_path / "c", "--repair", "--json")
    (writer,) = strict_json(result.stdout)["namespaces"][0]["writers"]
    assert result.exit_code == 1 and writer["repaired"] == 1
    assert writer["problem"] == "log.kvt is a FIFO; so it was not started afresh"


def test_verify_prints_no_progress_to_a_pipe(tmp_path):
    make_cache(tmp_path / "c", 1)
    result = kvtier("verify", tmp_path / "c")
    assert result.exit_code == 0 and result.stdout.splitlines()[0].strip().startswith("kvtier verify")


def test_the_plot_hint_keeps_its_brackets(tmp_path, monkeypatch):
    import sys

    from kvtier.cli import bench
    from kvtier.cli.app import console

    monkeypatch.setitem(sys.modules, "kvtier.bench.plot", None)  # matplotlib is not installed
    with console.capture() as captured:
        assert bench._write({}, tmp_path / "out") is None
    assert "pip install 'kvtier[bench]'" in captured.get()
