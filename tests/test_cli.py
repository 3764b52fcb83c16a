"""The ``kvtier`` command as a user runs it: a separate process."""

import json

from tests.helpers.cli import run


def test_help_lists_the_commands():
    result = run("--help")
    assert result.returncode == 0
    assert "config" in result.stdout and "version" in result.stdout


def test_config_json_shows_values_and_sources():
    result = run("config", "--json", env={"KVTIER_HOST_CAPACITY": "2GiB"})
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["config"]["host_capacity"] == 2 * 2**30
    assert data["sources"] == {"host_capacity": "environment KVTIER_HOST_CAPACITY"}


def test_config_table_is_readable():
    result = run("config", env={"KVTIER_HOST_CAPACITY": "2GiB"})
    assert result.returncode == 0
    assert "2GiB" in result.stdout and "KVTIER_HOST_CAPACITY" in result.stdout


def test_bad_config_exits_2_with_the_key_named():
    result = run("config", env={"KVTIER_COMPRESSION": "lz4"})
    assert result.returncode == 2
    assert "'compression'" in result.stderr and "none | zstd" in result.stderr
    assert "Traceback" not in result.stderr


def test_bench_bad_argument_exits_2_with_one_line_and_no_traceback(tmp_path):
    result = run("bench", "--depths", "0", "--size", "4MiB", "--out", str(tmp_path / "out"))
    assert result.returncode == 2
    assert result.stderr.strip() == "kvtier: bench: --depths must each be from 1 to 256, got [0]"
    assert not (tmp_path / "out").exists()


def test_stats_with_nothing_listening_exits_1_with_one_line():
    result = run("stats", "127.0.0.1:1", "--timeout", "2")
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvtier: stats: cannot read metrics from")
