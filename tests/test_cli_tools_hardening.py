"""Bad input to ``kvtier stats`` and ``kvtier bench``: one ``kvtier: ...`` line on stderr and
a documented exit code (1: the run or the endpoint failed, 2: a bad argument), never a
traceback, and never a hang."""

import contextlib
import json
import os
import subprocess
import time

import pytest
from typer.testing import CliRunner

from kvtier.bench import offload
from kvtier.cli.main import app
from tests.helpers.cli import refused
from tests.helpers.metrics import Handler, serving

runner = CliRunner()
TINY = ["bench", "--size", "4MiB", "--depths", "1", "--no-baselines"]


def invoke(*args):
    clean = {k: None for k in os.environ if k.startswith("KVTIER_")}
    return runner.invoke(app, list(args), env=clean)


# ---- kvtier stats URL -------------------------------------------------------


class Trickling(Handler):
    def do_GET(self):  # a whole answer, status line included, a byte at a time
        body = b"kvtier_chunks_stored_total 1\n" * 100
        head = b"HTTP/1.0 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body)
        self.send_raw(head + body, pause=0.2)


class HugeLength(Handler):
    def do_GET(self):  # announces 3 GiB; streams zeros until the client leaves
        self.send_response(200)
        self.send_header("Content-Length", str(3 * 2**30))
        self.end_headers()
        self.send_raw(bytes(48 * 2**20))


class Endless(Handler):
    def do_GET(self):  # no length at all: the body ends when the server closes
        self.send_response(200)
        self.end_headers()
        self.send_raw(b"# a comment line, over and over\n" * (48 * 2**20 // 32))


class OtherMetrics(Handler):
    def do_GET(self):
        body = b"# TYPE http_requests_total counter\nhttp_requests_total 7\n"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class NotPrometheus(Handler):
    def do_GET(self):
        body = b"<html><body>hello</body></html>\n"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class Failing(Handler):
    def do_GET(self):
        self.send_error(500, "broken")


class NoContent(Handler):
    def do_GET(self):
        self.send_response(204)
        self.end_headers()


def test_trickling_server_is_cut_at_the_deadline():
    with serving(Trickling) as address:
        start = time.monotonic()
        result = invoke("stats", address, "--timeout", "1")
        elapsed = time.monotonic() - start
    refused(result, 1, address, "within 1 s")
    assert elapsed < 3, f"took {elapsed:.1f} s with a 1 s timeout"


def test_timeout_must_be_positive():
    refused(invoke("stats", "127.0.0.1:9", "--timeout", "0"), 2, "--timeout")


def test_huge_content_length_is_refused_without_reading_it():
    with serving(HugeLength) as address:
        start = time.monotonic()
        result = invoke("stats", address)
        elapsed = time.monotonic() - start
    refused(result, 1, "larger than 32 MiB")
    assert elapsed < 10


def test_body_without_length_is_cut_at_the_size_bound():
    with serving(Endless) as address:
        result = invoke("stats", address, "--json")
    refused(result, 1, "larger than 32 MiB")
    assert result.stdout == ""


def test_endpoint_without_kvtier_metrics_exits_1():
    with serving(OtherMetrics) as address:
        table, as_json = invoke("stats", address), invoke("stats", address, "--json")
    for result in (table, as_json):
        refused(result, 1, f"no kvtier metrics at http://{address}/metrics")
    assert as_json.stdout == ""


@pytest.mark.parametrize("handler, status", [(Failing, "HTTP 500"), (NoContent, "HTTP 204")])
def test_status_other_than_200_exits_1_with_the_status(handler, status):
    with serving(handler) as address:
        result = invoke("stats", address)
    refused(result, 1, status)


def test_a_page_that_is_not_prometheus_text_exits_1():
    with serving(NotPrometheus) as address:
        result = invoke("stats", address)
    refused(result, 1, "not Prometheus text")


def test_bad_address_is_a_bad_argument():
    refused(invoke("stats", "ftp://127.0.0.1/metrics"), 2, "not an http(s) address")
    refused(invoke("stats", "127.0.0.1:notaport"), 2, "stats:")


# ---- kvtier bench -----------------------------------------------------------


@pytest.fixture
def no_run(monkeypatch):
    """Arguments are checked before any work: the benchmark itself must not start."""
    def started(*args, **kwargs):
        raise AssertionError("the benchmark ran before its arguments were checked")
    monkeypatch.setattr(offload, "run", started)


@pytest.mark.parametrize("args, words", [
    (["--depths", "0"], ["--depths", "1 to 256"]),
    (["--depths", "257"], ["--depths", "1 to 256"]),
    (["--depths", "1,,4"], ["--depths", "whole numbers"]),
    (["--chunk-tokens", "0"], ["--chunk-tokens"]),
    (["--chunk-tokens", "-4"], ["--chunk-tokens"]),
    (["--size", "0"], ["--size"]),
    (["--size", "lots"], ["--size"]),
    (["--prompt-tokens", "1024,-1"], ["--prompt-tokens"]),
    (["--prompt-tokens", "0"], ["--prompt-tokens"]),
    (["--layers", "-1", "--kv-heads", "8", "--head-dim", "128"], ["--layers", "at least 1"]),
])
def test_non_positive_numbers_exit_2_before_any_work(no_run, tmp_path, args, words):
    refused(invoke(*TINY, "--out", str(tmp_path / "out"), *args), 2, "bench:", *words)


@pytest.mark.parametrize("tps", ["0", "-5", "nan"])
def test_prefill_tps_zero_or_negative_is_refused(no_run, tmp_path, tps):
    refused(invoke(*TINY, "--out", str(tmp_path / "out"), "--prefill-tps", tps), 2,
            "--prefill-tps")


@pytest.mark.parametrize("tps", [0.0, -5.0])
def test_bench_spec_refuses_a_prefill_tps_it_would_replace_or_negate(tps):
    with pytest.raises(ValueError, match="--prefill-tps"):
        offload.BenchSpec(offload.PRESETS["llama-3-8b"], "llama-3-8b", prefill_tps=tps, disk=False)


def test_chunks_under_4kib_are_refused_naming_the_minimum(no_run, tmp_path):
    result = invoke(*TINY, "--out", str(tmp_path / "out"), "--model", "custom", "--layers", "1",
                    "--kv-heads", "1", "--head-dim", "8", "--chunk-tokens", "16")
    refused(result, 2, "512-byte chunks", "4096 bytes")


def test_chunks_not_a_multiple_of_4kib_fill_the_host_tier(tmp_path):
    out = tmp_path / "out"  # 6 KiB chunks take 8 KiB slots: the host tier must hold them all
    result = invoke(*TINY, "--size", "1MiB", "--no-disk", "--out", str(out), "--json",
                    "--model", "custom", "--layers", "1", "--kv-heads", "3", "--head-dim", "64",
                    "--chunk-tokens", "8")
    assert result.exception is None, result.exception
    assert json.loads((out / "bench.json").read_text())["chunk_bytes"] == 6144


def test_out_that_is_a_file_is_refused_up_front(no_run, tmp_path):
    (tmp_path / "taken").write_text("")
    refused(invoke(*TINY, "--out", str(tmp_path / "taken")), 2, "--out", "not a directory")


def test_disk_path_that_is_a_file_is_refused(no_run, tmp_path):
    (tmp_path / "file").write_text("")
    refused(invoke(*TINY, "--out", str(tmp_path / "out"), "--disk-path", str(tmp_path / "file")),
            2, "--disk-path", "not a directory")


def test_disk_path_symlink_is_refused(no_run, tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    refused(invoke(*TINY, "--out", str(tmp_path / "out"), "--disk-path", str(tmp_path / "link")),
            2, "--disk-path", "symbolic link")


def test_bench_creates_a_missing_disk_path_private_and_leaves_no_probe(no_run, tmp_path):
    made = tmp_path / "new" / "disk"
    result = invoke(*TINY, "--out", str(tmp_path / "out"), "--disk-path", str(made))
    assert "before its arguments" in str(result.exception)  # the checks passed; the run began
    assert made.is_dir() and made.stat().st_mode & 0o777 == 0o700
    assert list(made.iterdir()) == []


@contextlib.contextmanager
def tmpfs(path, options: str):
    path.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "none", str(path)],
                             capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


@contextlib.contextmanager
def read_only_directory(path):
    """A directory this user cannot write into: chmod for a user, a read-only mount for root."""
    if os.geteuid() != 0:
        path.mkdir()
        path.chmod(0o500)
        try:
            yield path
        finally:
            path.chmod(0o700)
        return
    with tmpfs(path, "size=1m,ro") as mounted:
        yield mounted


def test_read_only_disk_path_is_refused_up_front(no_run, tmp_path):
    with read_only_directory(tmp_path / "ro") as ro:
        result = invoke(*TINY, "--out", str(tmp_path / "out"), "--disk-path", str(ro))
    refused(result, 2, "--disk-path", "write into")


def test_read_only_out_is_refused_up_front(no_run, tmp_path):
    with read_only_directory(tmp_path / "ro") as ro:
        result = invoke(*TINY, "--out", str(ro / "results"))
    refused(result, 2, "--out", "write into")


def test_full_disk_during_the_run_exits_1_with_one_line(tmp_path):
    with tmpfs(tmp_path / "full", "size=64k") as full:
        result = invoke(*TINY, "--out", str(tmp_path / "out"), "--disk-path", str(full))
    refused(result, 1, "run failed", "no_space")


def fill(directory) -> None:
    """Take every free block of ``directory``'s file system (a new empty file still fits)."""
    with contextlib.suppress(OSError), open(directory / "filler", "wb") as f:
        while True:
            f.write(bytes(4096))
            f.flush()


def test_full_out_directory_exits_1_with_one_line(tmp_path):
    with tmpfs(tmp_path / "full", "size=64k") as full:
        fill(full)
        result = invoke(*TINY, "--no-disk", "--out", str(full))
    refused(result, 1, "cannot write the results", "No space left")


def test_io_error_during_the_run_exits_1(monkeypatch, tmp_path):
    def failing(*args, **kwargs):
        raise OSError(5, "Input/output error")
    monkeypatch.setattr(offload, "measure_disk_tier", failing)
    result = invoke(*TINY, "--out", str(tmp_path / "out"), "--disk-path", str(tmp_path / "d"))
    refused(result, 1, "run failed", "Input/output error")


def test_bench_store_is_named_after_the_preset(monkeypatch):
    names = []
    real = offload.KVStore

    def recording(layout, config=None, **kwargs):
        names.append(kwargs.get("model"))
        return real(layout, config, **kwargs)
    monkeypatch.setattr(offload, "KVStore", recording)
    spec = offload.BenchSpec(offload.PRESETS["llama-3-8b"], "llama-3-8b", chunk_tokens=1,
                             size=1, disk=False)
    offload.bench_host(spec, lambda n: None)
    assert names == ["kvtier-bench/llama-3-8b"]


def test_bench_leaves_the_users_entries_in_its_disk_path_alone(tmp_path):
    disk = tmp_path / "disk"
    (disk / "naive").mkdir(parents=True, mode=0o700)
    (disk / "naive" / "keep.txt").write_text("the user's")
    args = [a for a in TINY if a != "--no-baselines"]
    result = invoke(*args, "--out", str(tmp_path / "out"), "--disk-path", str(disk))
    assert result.exit_code == 0, result.output
    assert (disk / "naive" / "keep.txt").read_text() == "the user's"
    assert sorted(p.name for p in disk.iterdir()) == ["naive"]  # and nothing of its own is left


def test_stats_timeout_bounds_a_resolver_that_does_not_answer(monkeypatch):
    import socket

    real = socket.getaddrinfo

    def slow_resolver(host, *args, **kwargs):
        time.sleep(3)  # a name server that does not answer for a while
        return real("127.0.0.1", *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", slow_resolver)
    started = time.monotonic()
    result = CliRunner().invoke(app, ["stats", "metrics.example:9", "--timeout", "0.5"])
    assert time.monotonic() - started < 2.5
    assert result.exit_code == 1 and "not resolved within 0.5 s" in result.output, result.output
