"""``kvtier top``: its figures from canned metric pages and from the real collectors, the
command's exits, and the live view in a real terminal (tmux) while a store is under load."""

import http.server
import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from kvtier import KVStore
from kvtier.cli.deadline import Deadline
from kvtier.cli.stats import metrics_url, parse_samples
from kvtier.cli.top_figures import Role, figures
from kvtier.cli.top_render import render
from kvtier.cli.top_scrape import Endpoint, Scrape, scrape
from kvtier.config.settings import load_config
from kvtier.connector.common.geometry import KVGeometry
from kvtier.connector.scheduler.side import SchedulerSide
from kvtier.connector.worker.ledger import WorkerLedger
from kvtier.metrics import serve_metrics
from tests.helpers.kv import SMALL, make_kv

ROOT = Path(__file__).resolve().parents[1]
KVTIER = [sys.executable, "-m", "kvtier.cli.main"]
WAIT_S = 60  # bound of every wait for a process or a screen


def page(**values: float) -> str:
    """A store's metrics page (the Prometheus text a KVStore serves), with ``values``."""
    v = {"host": 0, "disk": 0, "missed": 0, "read": 0, "write": 0, "io_errors": 0,
         "corruptions": 0, "queue": 0, "down": 0, **values}
    return f"""# HELP kvtier_chunks_loaded_total Chunks loaded, by the tier they came from
# TYPE kvtier_chunks_loaded_total counter
kvtier_chunks_loaded_total{{tier="host"}} {v['host']}
kvtier_chunks_loaded_total{{tier="disk"}} {v['disk']}
# TYPE kvtier_chunks_missed_total counter
kvtier_chunks_missed_total {v['missed']}
# TYPE kvtier_slots gauge
kvtier_slots{{tier="host"}} 8
kvtier_slots{{tier="disk"}} 64
# TYPE kvtier_used_slots gauge
kvtier_used_slots{{tier="host"}} 2
kvtier_used_slots{{tier="disk"}} 16
# TYPE kvtier_disk_bytes_total counter
kvtier_disk_bytes_total{{direction="read"}} {v['read']}
kvtier_disk_bytes_total{{direction="write"}} {v['write']}
# TYPE kvtier_io_errors_total counter
kvtier_io_errors_total {v['io_errors']}
kvtier_corruptions_total {v['corruptions']}
kvtier_chunks_stored_total 5
kvtier_io_queue_depth {v['queue']}
kvtier_paths_down {v['down']}
"""


def read(text: str, at: float, url: str = "store") -> Scrape:
    return Scrape.of(url, at, parse_samples(text.encode()))


def test_store_figures_are_rates_and_shares_over_the_interval():
    before = read(page(host=10, disk=4, missed=6, read=4096, write=8192, io_errors=1), at=100.0)
    after = read(page(host=16, disk=10, missed=8, read=4096 + 2 * 2**20, write=8192, io_errors=3,
                      queue=5, down=1), at=102.0)
    view = figures(before, after)
    assert view.role is Role.STORE and view.seconds == 2.0
    host, disk = view.tiers
    assert (host.tier, disk.tier) == ("host", "disk")
    assert (host.hits, host.hits_per_s, disk.hits_per_s) == (16, 3.0, 3.0)
    assert (host.hit_ratio, disk.hit_ratio) == (6 / 14, 6 / 14)  # 6 + 6 loaded, 2 missed
    assert (host.fill, disk.fill) == (0.25, 0.25)
    assert (disk.in_per_s, disk.out_per_s) == (0.0, 2**20)
    assert (host.in_per_s, host.out_per_s) == (None, None)  # a store counts no host bytes
    assert (view.queue_depth, view.paths_down) == (5, 1)
    assert [(f.name, f.total, f.new) for f in view.failures] == [("io_errors", 3, 2)]


def test_a_counter_that_went_down_counts_from_zero_and_one_read_has_no_rates():
    before = read(page(disk=500, missed=100), at=0.0)
    after = read(page(disk=30, missed=10), at=10.0)  # the store restarted in between
    disk = figures(before, after).tiers[1]
    assert disk.hits_per_s == 3.0 and disk.hit_ratio == 30 / 40
    single = figures(None, after)
    assert single.seconds is None
    assert all(t.hits_per_s is None and t.hit_ratio is None and t.out_per_s is None
               for t in single.tiers)
    assert single.tiers[1].hits == 30 and single.tiers[1].fill == 0.25


def test_a_quiet_interval_has_no_hit_rate_rather_than_a_made_up_one():
    text = page(host=3, missed=1)
    view = figures(read(text, at=0.0), read(text, at=1.0))
    assert [t.hit_ratio for t in view.tiers] == [None, None]
    assert [t.hits_per_s for t in view.tiers] == [0.0, 0.0]


REMOTE_PAGE = """kvtier_slots{tier="host"} 8
kvtier_used_slots{tier="host"} 8
kvtier_chunks_missed_total 0
kvtier_chunks_loaded_total{tier="remote"} %d
kvtier_remote_bytes_total{backend="redis",direction="read"} %d
kvtier_remote_bytes_total{backend="redis",direction="write"} %d
kvtier_remote_failures_total{backend="redis"} %d
kvtier_remote_queue_depth{backend="redis"} 3
kvtier_remote_up{backend="redis"} %d
kvtier_io_queue_depth 0
kvtier_paths_down 2
"""


def test_a_remote_store_is_a_tier_and_its_outage_is_shown():
    view = figures(read(REMOTE_PAGE % (0, 0, 0, 0, 1), 0.0),
                   read(REMOTE_PAGE % (4, 4096, 1024, 2, 0), 1.0))
    host, remote = view.tiers
    assert remote.tier == "remote" and remote.hit_ratio == 1.0 and host.hit_ratio == 0.0
    assert (remote.out_per_s, remote.in_per_s) == (4096, 1024)
    assert [(f.name, f.total, f.new) for f in view.failures] == [("remote_failures", 2, 2)]
    assert (view.remote_queue_depth, view.remote_up, view.paths_down) == (3, 0, 2)
    from rich.console import Console

    console = Console(record=True, width=250)
    console.print(render([view], 1.0))
    first = next(cells(line) for line in console.export_text().splitlines() if line.startswith("│"))
    assert first[10:] == ["0 + 3 remote", "remote_failures 2 (+2)", "2 disk paths, remote store"]


def test_a_clusters_nodes_out_alone_are_shown_while_the_store_is_in_service():
    page = REMOTE_PAGE + "kvtier_remote_nodes_out{backend=\"redis\"} %d\n"
    view = figures(read(page % (0, 0, 0, 0, 1, 0), 0.0), read(page % (4, 4096, 1024, 2, 1, 1), 1.0))
    assert (view.remote_up, view.remote_nodes_out) == (1, 1)
    from rich.console import Console

    console = Console(record=True, width=250)
    console.print(render([view], 1.0))
    first = next(cells(line) for line in console.export_text().splitlines() if line.startswith("│"))
    assert first[-1] == "2 disk paths, 1 remote nodes"


SCHEDULER_PAGE = """kvtier_chunks_loaded_total{tier="host"} %d
kvtier_chunks_loaded_total{tier="disk"} 0
kvtier_slots{tier="host"} 4
kvtier_used_slots{tier="host"} 4
kvtier_load_failures_total %d
kvtier_room_waits_total 0
kvtier_loads_skipped_total 0
"""
WORKER_PAGE = """kvtier_load_bytes_total{tier="host"} %d
kvtier_load_bytes_total{tier="disk"} %d
kvtier_worker_store_bytes_total %d
kvtier_worker_disk_write_bytes_total 0
kvtier_io_queue_depth 2
kvtier_worker_loads_total 1
kvtier_worker_paths_down_total %d
"""


def test_whether_a_tiers_loads_pay_is_the_prefill_they_saved_per_second_they_took():
    paying = SCHEDULER_PAGE % (6, 0) + """kvtier_load_seconds_total{tier="host"} 0.5
kvtier_seconds_saved_total{tier="host"} 6.0
kvtier_load_seconds_total{tier="disk"} 0
kvtier_seconds_saved_total{tier="disk"} 0
"""
    host, disk = figures(None, read(paying, 0.0)).tiers
    assert host.pays == 12.0 and disk.pays is None  # no load from disk yet: nothing to say
    from rich.console import Console

    console = Console(record=True, width=250)
    console.print(render([figures(None, read(paying, 0.0))], 1.0))
    rows = [cells(line) for line in console.export_text().splitlines() if line.startswith("│")]
    assert [r[9] for r in rows] == ["12.0x", "-"]


def test_scheduler_side_figures_have_hits_and_no_bytes():
    view = figures(read(SCHEDULER_PAGE % (2, 0), 0.0), read(SCHEDULER_PAGE % (6, 1), 4.0))
    assert view.role is Role.SCHEDULER
    (host, disk) = view.tiers
    assert host.hits_per_s == 1.0 and host.fill == 1.0 and disk.fill is None
    assert host.hit_ratio is None  # the scheduler side does not count misses
    assert host.in_per_s is None and host.out_per_s is None and view.queue_depth is None
    assert [(f.name, f.new) for f in view.failures] == [("load_failures", 1)]


def test_worker_figures_have_bytes_by_tier_and_paths_that_went_down():
    view = figures(read(WORKER_PAGE % (0, 0, 0, 0), 0.0), read(WORKER_PAGE % (4096, 8192, 2048, 1), 2.0))
    assert view.role is Role.WORKER
    host, disk = view.tiers
    assert (host.out_per_s, disk.out_per_s, host.in_per_s, disk.in_per_s) == (2048, 4096, 1024, 0)
    assert host.hits is None and view.queue_depth == 2 and view.paths_down is None
    assert [(f.name, f.total) for f in view.failures] == [("paths_down", 1)]


def test_render_has_a_row_per_tier_and_the_endpoint_on_its_first():
    from rich.console import Console

    view = figures(read(page(), 0.0), read(page(host=4, missed=4, read=3 * 2**20), 1.0))
    console = Console(record=True, width=200)
    console.print(render([view, figures(None, read(WORKER_PAGE % (0, 0, 0, 0), 0.0, "w"))], 1.0))
    lines = console.export_text().splitlines()
    rows = [cells(line) for line in lines if line.startswith("│")]
    assert [r[:3] for r in rows] == [["store", "store", "host"], ["", "", "disk"],
                                     ["w", "worker", "host"], ["", "", "disk"]]
    assert rows[0][3:6] == ["4", "4.0", "50%"] and rows[1][7] == "3 MiB/s"
    assert rows[0][8] == "25%" and rows[0][9] == "-" and rows[0][11] == "none" and rows[2][4] == "-"


def cells(line: str, bar: str = "│") -> list[str]:
    return [cell.strip() for cell in line.strip().strip(bar).split(bar)]


# -- the real collectors, served as the store and the connector serve them --------------------


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextmanager
def served(collect: Callable) -> Iterator[Endpoint]:
    port = free_port()
    server = serve_metrics(port, collect)
    try:
        url = f"127.0.0.1:{port}"
        yield Endpoint(url, metrics_url(url))
    finally:
        server.close()


def test_the_figures_read_what_the_connector_serves():
    geometry = KVGeometry(num_layers=2, page_bytes=4096, block_tokens=16, hash_block_tokens=16,
                          chunk_tokens=32, kv_dtype="bfloat16", page_shape="t")
    side = SchedulerSide(load_config({"chunk_tokens": 32, "host_capacity": 4 * geometry.chunk_bytes},
                                     environ={}), geometry, [geometry.namespace("m", "", 1, 0)], 1)
    ledger = WorkerLedger()
    with served(side.metric_samples) as scheduler_end, served(ledger.metric_samples) as worker_end:
        before = [scrape(end, Deadline.after(5.0)) for end in (scheduler_end, worker_end)]
        side.counters.update(load_chunks_host=3, load_failed_chunks=1)
        with ledger.lock:
            ledger.record(lambda c: c.data.update(load_bytes_host=3 * 8192, stores=1,
                                                  store_bytes=8192, io_errors=1))
        sched, worker = (figures(b, scrape(e, Deadline.after(5.0))) for b, e in
                         zip(before, [scheduler_end, worker_end], strict=True))
    assert sched.role is Role.SCHEDULER and worker.role is Role.WORKER
    host = next(t for t in sched.tiers if t.tier == "host")
    assert host.hits == 3 and host.hits_per_s is not None and host.hits_per_s > 0
    assert host.fill == 0.0 and [f.name for f in sched.failures] == ["load_failures"]
    w_host = next(t for t in worker.tiers if t.tier == "host")
    assert w_host.out_per_s is not None and w_host.out_per_s > 0
    assert w_host.in_per_s is not None and w_host.in_per_s > 0
    assert worker.queue_depth == 0 and [f.name for f in worker.failures] == ["io_errors"]


def test_wrong_kv_found_by_sampled_checks_shows_as_a_failure_and_halted_hits():
    geometry = KVGeometry(num_layers=2, page_bytes=4096, block_tokens=16, hash_block_tokens=16,
                          chunk_tokens=32, kv_dtype="bfloat16", page_shape="t")
    side = SchedulerSide(load_config({"chunk_tokens": 32, "host_capacity": 4 * geometry.chunk_bytes},
                                     environ={}), geometry, [geometry.namespace("m", "", 1, 0)], 1)
    with served(side.metric_samples) as end:
        before = scrape(end, Deadline.after(5.0))
        side.counters.update(verify_mismatches_host=2, verify_halted=1)
        view = figures(before, scrape(end, Deadline.after(5.0)))
    assert [(f.name, f.total, f.new) for f in view.failures] == [("verify_mismatches", 2, 2)]
    assert view.hits_halted == 1
    from rich.console import Console

    console = Console(width=400, record=True)
    console.print(render([view], 1.0))
    text = console.export_text()
    assert "verify_mismatches 2 (+2)" in text and "hits (wrong KV found)" in text


# -- the command ------------------------------------------------------------------------------


def run(*args: str, timeout: float = WAIT_S) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    return subprocess.run([*KVTIER, "top", *args], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=ROOT)


class PagesServer(http.server.ThreadingHTTPServer):
    """Serves ``pages`` in turn on 127.0.0.1 (the last one again and again)."""

    def __init__(self, pages: list[str]) -> None:
        super().__init__(("127.0.0.1", 0), PageHandler)
        self.pages, self.served = pages, 0
        self.thread = threading.Thread(target=self.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/metrics"

    def stop(self) -> None:
        self.shutdown()
        self.server_close()


class PageHandler(http.server.BaseHTTPRequestHandler):
    server: PagesServer

    def do_GET(self) -> None:
        body = self.server.pages[min(self.server.served, len(self.server.pages) - 1)].encode()
        self.server.served += 1
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


def test_once_as_json_gives_the_figures_of_one_interval_from_each_endpoint():
    one, two = PagesServer([page(), page(disk=10)]), PagesServer([WORKER_PAGE % (0, 0, 0, 0)])
    try:
        result = run(one.url, two.url, "--json", "--interval", "0.2")
    finally:
        one.stop()
        two.stop()
    assert result.returncode == 0, result.stderr
    views = json.loads(result.stdout)
    assert [(v["url"], v["role"]) for v in views] == [(one.url, "store"), (two.url, "worker")]
    assert views[0]["tiers"][1]["hits"] == 10 and views[0]["tiers"][1]["hits_per_s"] > 0


def test_bad_arguments_exit_2_and_nothing_there_exits_1_each_with_one_line():
    for args, code, says in [(["127.0.0.1:1", "--interval", "0"], 2, "--interval must be"),
                             (["ftp://x/metrics"], 2, "not an http(s) address"),
                             (["127.0.0.1:1", "--once"], 1, "cannot read 127.0.0.1:1")]:
        result = run(*args)
        lines = result.stderr.strip().splitlines()
        assert result.returncode == code and len(lines) == 1, (args, result.stderr)
        assert lines[0].startswith("kvtier: top: ") and says in lines[0], lines


def test_a_page_without_kvtier_metrics_is_refused():
    other = PagesServer(["process_cpu_seconds_total 1.0\n"])
    try:
        result = run(other.url, "--once")
    finally:
        other.stop()
    assert result.returncode == 1 and "no kvtier metrics" in result.stderr


def test_a_lost_endpoint_ends_the_view_with_one_line_and_exit_1():
    server = PagesServer([page(), page(disk=5)])
    process = subprocess.Popen([*KVTIER, "top", server.url, "--interval", "0.2"], cwd=ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + WAIT_S
        while server.served < 3 and time.monotonic() < deadline and process.poll() is None:
            time.sleep(0.05)
        assert server.served >= 3, "kvtier top did not keep reading the endpoint"
        server.stop()
        out, err = process.communicate(timeout=WAIT_S)
    finally:
        process.kill()
    assert process.returncode == 1, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"kvtier: top: lost {server.url}: "), err
    assert "Traceback" not in err and "kvtier top" in out  # the last view stays on screen


# -- in a real terminal -------------------------------------------------------------------------


def prefix(i: int) -> list[int]:
    """The ``i % 40``-th of 40 prompts of 4 chunks each."""
    return list(range(i % 40 * 64, i % 40 * 64 + 64))


@contextmanager
def busy_store(tmp_path: Path) -> Iterator[tuple[KVStore, int]]:
    """A store with a disk tier serving metrics, stored into and read from by a thread."""
    port = free_port()
    (tmp_path / "disk").mkdir(mode=0o700)
    store = KVStore(SMALL, {"chunk_tokens": 16, "host_capacity": "16KiB", "disk_capacity": "1MiB",
                            "disk_paths": [str(tmp_path / "disk")], "metrics_port": port},
                    model="top-test")
    stop = threading.Event()

    def load() -> None:
        for i in range(10**9):
            if stop.wait(0.01):
                return
            tokens, older = prefix(i), prefix(i - 5)  # older: out of host memory, on disk
            store.put(tokens, make_kv(tokens))
            for asked in (tokens, older):
                store.get(asked, torch.empty(SMALL.shape(64), dtype=torch.bfloat16))

    thread = threading.Thread(target=load, daemon=True)
    thread.start()
    try:
        yield store, port
    finally:
        stop.set()
        thread.join(timeout=WAIT_S)
        store.close()


class Tmux:
    """A private tmux server (its own socket, no user config) running one command a session."""

    def __init__(self, name: str) -> None:
        self.base = ["tmux", "-L", name, "-f", "/dev/null"]

    def start(self, session: str, command: str) -> None:
        # the terminal gives the size: COLUMNS and LINES (pytest-xdist's workers set 80x24)
        # would override it
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("KVTIER_", "TMUX")) and k not in ("COLUMNS", "LINES")}
        subprocess.run([*self.base, "new-session", "-d", "-s", session, "-x", "200", "-y", "40",
                        "-c", str(ROOT), command], check=True, env=env, timeout=WAIT_S)

    def screen(self, session: str) -> str:
        return subprocess.run([*self.base, "capture-pane", "-p", "-t", session], check=True,
                              capture_output=True, text=True, timeout=WAIT_S).stdout

    def keys(self, session: str, *keys: str) -> None:
        subprocess.run([*self.base, "send-keys", "-t", session, *keys], check=True, timeout=WAIT_S)

    def wait(self, session: str, found: Callable[[str], object]) -> object:
        """``found(screen)`` once it is truthy; fails with the screen after ``WAIT_S``."""
        deadline = time.monotonic() + WAIT_S
        while True:
            screen = self.screen(session)
            if result := found(screen):
                return result
            assert time.monotonic() < deadline, f"not found on the screen of {session}:\n{screen}"
            time.sleep(0.2)

    def close(self) -> None:
        subprocess.run([*self.base, "kill-server"], capture_output=True, timeout=WAIT_S)


def hits_on(screen: str) -> tuple[int, str] | None:
    """(hits from every tier, hits/s of the disk tier) in ``kvtier top``'s table, or None
    before it shows."""
    header = next((cells(line, "┃") for line in screen.splitlines() if "┃ endpoint" in line), None)
    rows = [dict(zip(header, cells(line), strict=False)) for line in screen.splitlines()
            if header and line.startswith("│")]
    if not rows:
        return None
    hits = sum(int(row["hits"].replace(",", "")) for row in rows if row["hits"] != "-")
    return hits, next(row["hits/s"] for row in rows if row["tier"] == "disk")


@pytest.mark.skipif(shutil.which("tmux") is None,
                    reason="tmux is not installed (apt-get install tmux): kvtier top's live view "
                           "is tested in a real terminal")
def test_top_refreshes_in_place_in_a_terminal_quits_on_ctrl_c_and_on_a_lost_endpoint(tmp_path):
    tmux = Tmux(f"kvtier-top-{os.getpid()}")
    try:
        with busy_store(tmp_path) as (_, port):
            command = shlex.join([*KVTIER, "top", f"127.0.0.1:{port}", "--interval", "0.3"])
            for session in ("quit", "lost"):
                tmux.start(session, f"{command}; echo kvtier-top-exit=$?; sleep {3 * WAIT_S}")
            tmux.wait("lost", hits_on)  # a first view read before the store goes (a loaded
            first = tmux.wait("quit", hits_on)  # machine can start it late: "cannot read")
            moved = tmux.wait("quit", lambda s: (h := hits_on(s)) and h[0] > first[0] and h)
            assert moved[1] != "-"  # a rate, once two reads are in
            screen = tmux.screen("quit")
            assert screen.count("kvtier top: every 0.3 s") == 1  # refreshed in place
            tmux.keys("quit", "C-c")
            tmux.wait("quit", lambda s: "kvtier-top-exit=" in s)
            assert "kvtier-top-exit=0" in tmux.screen("quit")
            assert "Traceback" not in tmux.screen("quit") and "Aborted" not in tmux.screen("quit")
        lost = tmux.wait("lost", lambda s: "kvtier-top-exit=" in s and s)
        assert "kvtier-top-exit=1" in lost and f"kvtier: top: lost 127.0.0.1:{port}:" in lost
        assert "Traceback" not in lost
    finally:
        tmux.close()


class CountingValues(dict):
    """A scrape's samples that count how many entries every pass over them reads."""

    read = 0

    def __iter__(self):
        for key in super().__iter__():
            CountingValues.read += 1
            yield key


class CountingLabels(tuple):
    """A sample's label set that counts how often it is looked through."""

    def __iter__(self):
        CountingValues.read += 1
        return super().__iter__()


@pytest.mark.parametrize("extra", [2_000, 8_000])
def test_top_reads_a_page_a_bounded_number_of_times_whatever_its_size(extra):
    """A page of N samples (here many distinct failure-like names and many tiers) costs
    O(N) to show: every figure once went over every sample (quadratic: 10,000 samples took
    over a minute)."""
    samples = [{"name": "kvtier_slots", "labels": {"tier": "host"}, "value": "4"},
               {"name": "kvtier_chunks_loaded_total", "labels": {"tier": "host"}, "value": "1"}]
    samples += [{"name": f"kvtier_failure{i}_total", "labels": {}, "value": "1"}
                for i in range(extra // 2)]
    samples += [{"name": "kvtier_slots", "labels": {"tier": f"t{i}"}, "value": "1"}
                for i in range(extra // 2)]
    before = Scrape.of("u", 0.0, samples)
    after = Scrape("u", 1.0, CountingValues({(name, CountingLabels(labels)): value for
                                             (name, labels), value in before.values.items()}))
    CountingValues.read = 0
    shown = figures(before, after)
    assert shown.tiers and CountingValues.read <= 8 * len(samples)
