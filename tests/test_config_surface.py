"""The configuration's surface as a user meets it: files, YAML's booleans, units, bounds,
and ``kvtier config``'s printing. Test names say which finding of the audit they pin down."""

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvtier.config.settings import KEYS, ODirect, load_config, read_config_file
from kvtier.errors import ConfigError
from kvtier.units import parse_size

DOCS = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"
OFF_KEYS = ("disk_retry", "load_timeout", "staging_wait", "share_refresh", "metrics_port",
            "remote_url")


def config_error(overrides=None, environ=None) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(overrides, environ=environ or {})
    return str(info.value)


def in_file(tmp_path, name: str, text: str) -> dict[str, str]:
    path = tmp_path / name
    path.write_text(text)
    return {"KVTIER_CONFIG": str(path)}


def doc_row(key: str) -> str:
    return next(line for line in DOCS.read_text().splitlines() if line.startswith(f"| `{key}` |"))


# keys inside and outside a [kvtier] table

@pytest.mark.parametrize(("name", "text"), [
    ("c.toml", 'host_capacity = "1GiB"\n[kvtier]\nio_threads = 4\n'),
    ("c.yaml", "host_capacity: 1GiB\nkvtier:\n  io_threads: 4\n"),
    ("c.yaml", "host_capacity: 1GiB\nkvtier: {}\n"),
    ("c.json", json.dumps({"host_capacity": "1GiB", "kvtier": {"io_threads": 4}})),
])
def test_keys_outside_the_kvtier_table_are_refused(tmp_path, name, text):
    message = config_error(environ=in_file(tmp_path, name, text))
    assert str(tmp_path / name) in message and "'host_capacity'" in message
    assert "kvtier table" in message


def test_a_kvtier_table_alone_still_works(tmp_path):
    environ = in_file(tmp_path, "c.toml", '[kvtier]\nio_threads = 4\nhost_capacity = "1GiB"\n')
    config = load_config(environ=environ)
    assert (config.io_threads, config.host_capacity) == (4, 2**30)


# duplicate keys in YAML and JSON

@pytest.mark.parametrize(("name", "text"), [
    ("c.yaml", "io_threads: 4\nio_threads: 8\n"),
    ("c.yaml", "kvtier:\n  io_threads: 4\n  io_threads: 8\n"),
    ("c.json", '{"io_threads": 4, "io_threads": 8}'),
    ("c.json", '{"kvtier": {"io_threads": 4, "io_threads": 8}}'),
])
def test_a_key_given_twice_in_a_file_is_refused(tmp_path, name, text):
    message = config_error(environ=in_file(tmp_path, name, text))
    assert "gives key 'io_threads' twice" in message and str(tmp_path / name) in message


def test_a_key_given_twice_in_toml_is_refused_too(tmp_path):
    config_error(environ=in_file(tmp_path, "c.toml", "io_threads = 4\nio_threads = 8\n"))


def test_a_yaml_merge_is_not_a_key_given_twice(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("x: &base {io_threads: 2, chunk_tokens: 64}\ny:\n  <<: *base\n  io_threads: 4\n")
    assert read_config_file(path)["y"] == {"io_threads": 4, "chunk_tokens": 64}


# metrics ports above 65535

def test_serve_metrics_refuses_a_port_above_65535_with_a_config_error():
    from kvtier.metrics import serve_metrics

    with pytest.raises(ConfigError, match=r"metrics_port=65536 cannot be served"):
        serve_metrics(65536, lambda: [], "127.0.0.1")


def fake_vllm_config(extra: dict, tp: int, dp: int = 0) -> SimpleNamespace:
    return SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra),
                           parallel_config=SimpleNamespace(
                               tensor_parallel_size=tp, data_parallel_rank=dp,
                               data_parallel_rank_local=dp))


@pytest.mark.parametrize(("port", "tp"), [(65535, 1), (65534, 2), (65530, 8)])
def test_the_connector_refuses_a_metrics_port_its_workers_cannot_serve(monkeypatch, port, tp):
    pytest.importorskip("vllm")
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvtier.connector.connector import KVTierConnector

    for name in [n for n in os.environ if n.startswith("KVTIER_")]:
        monkeypatch.delenv(name)
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(ConfigError) as info:
            KVTierConnector(fake_vllm_config({"metrics_port": port}, tp), role)
        message = str(info.value)
        assert f"bad value {port} for 'metrics_port' (given config)" in message
        assert f"{tp} TP ranks at DP rank 0" in message and f"1-{65535 - tp}," in message


def test_a_metrics_port_that_fits_every_rank_passes():
    pytest.importorskip("vllm")
    from kvtier.connector.connector import metrics_base

    assert metrics_base(load_config({"metrics_port": 65533}, environ={}), 2) == 65533
    assert metrics_base(load_config(environ={}), 4096) == 0  # no port: nothing to check


def test_each_data_parallel_engine_on_a_host_serves_metrics_on_ports_of_its_own():
    """Engines of DP ranks 0..d on one host each serve a scheduler side and a worker per TP
    rank: the engine of DP rank d starts at ``metrics_port + d * (1 + TP)`` (they all took
    ``metrics_port``, and every engine but the first failed to start: a review)."""
    pytest.importorskip("vllm")
    from kvtier.connector.connector import metrics_base

    config = load_config({"metrics_port": 9400}, environ={})
    ports = [{metrics_base(config, 2, dp) + r for r in range(3)} for dp in range(4)]
    assert set.union(*ports) == set(range(9400, 9412))
    with pytest.raises(ConfigError, match="DP rank 3"):
        metrics_base(load_config({"metrics_port": 65530}, environ={}), 2, 3)


# disk_min_free printed exactly

@pytest.mark.parametrize("given", ["0.5%", "2.5%", "7%", "12.3456789%", "99.9%", "0.001%", " 5 %"])
def test_a_percentage_is_printed_exactly_and_reads_back(given):
    config = load_config({"disk_min_free": given}, environ={})
    shown = config.as_dict()["disk_min_free"]
    assert shown == given.replace(" ", "")
    assert load_config({"disk_min_free": shown}, environ={}).disk_min_free == config.disk_min_free


# YAML's off is false

@pytest.mark.parametrize("key", OFF_KEYS)
def test_yaml_off_is_off(tmp_path, key):
    config = load_config(environ=in_file(tmp_path, "c.yaml", f"{key}: off\n"))
    assert getattr(config, key) is None
    assert config.as_dict()[key] in ("off", "", None)


@pytest.mark.parametrize("key", OFF_KEYS)
def test_false_is_off_and_true_is_refused(key):
    assert getattr(load_config({key: False}, environ={}), key) is None
    message = config_error({key: True})
    assert f"bad value True for '{key}' (given config)" in message and "allowed:" in message


@pytest.mark.parametrize(("text", "expected"), [("on", ODirect.ON), ("off", ODirect.OFF),
                                                ("true", ODirect.ON), ("no", ODirect.OFF)])
def test_yaml_booleans_for_o_direct(tmp_path, text, expected):
    assert load_config(environ=in_file(tmp_path, "c.yaml", f"o_direct: {text}\n")).o_direct is expected


# bare K, M, G, T

@pytest.mark.parametrize(("given", "number", "letter"), [("4G", "4", "G"), ("4g", "4", "G"),
                                                         ("64k", "64", "K"), ("1.5 m", "1.5", "M"),
                                                         ("2T", "2", "T")])
def test_a_bare_unit_letter_is_refused_with_both_spellings_suggested(given, number, letter):
    with pytest.raises(ValueError, match=f"write {number}{letter}iB .* or {number}{letter}B"):
        parse_size(given)
    message = config_error({"host_capacity": given})
    assert "'host_capacity'" in message and f"{number}{letter}iB" in message


def test_bytes_may_carry_a_b():
    assert parse_size("4096B") == parse_size("4096b") == parse_size("4096") == 4096
    assert "`4096B`" in DOCS.read_text() and "A bare `K`, `M`, `G` or `T`" in DOCS.read_text()


# the upper bound of chunk_tokens and remote_min_hits

@pytest.mark.parametrize("key", ["chunk_tokens", "remote_min_hits"])
def test_the_upper_bound_is_stated(key):
    assert getattr(load_config({key: 2**20}, environ={}), key) == 2**20
    message = config_error({key: 2**20 + 1})
    assert "out of range" in message and "1048576" in message.partition("allowed:")[2]
    assert "1048576" in doc_row(key)


# o_direct is auto | true | false

@pytest.mark.parametrize(("given", "shown"), [("auto", "auto"), ("true", "true"), (" FALSE ", "false"),
                                              (True, "true"), (False, "false"), ("on", "true"),
                                              ("OFF", "false")])
def test_o_direct_takes_and_prints_what_the_doc_says(given, shown):
    config = load_config({"o_direct": given}, environ={})
    assert config.as_dict()["o_direct"] == shown
    assert load_config({"o_direct": shown}, environ={}).o_direct is config.o_direct


@pytest.mark.parametrize("given", ["1", "0", 1, 0, "yes"])
def test_o_direct_refuses_undocumented_values(given):
    assert "allowed: auto | true | false" in config_error({"o_direct": given})


# kvtier config prints what reads back

ODD = {"chunk_tokens": 48, "gpu_capacity": "1.5GiB", "host_capacity": 1000000007,
       "disk_capacity": "100GB", "disk_paths": ["/a", "/b,c"], "disk_min_free": "4096B",
       "disk_retry": "12345.678s", "load_timeout": "1.1ms", "staging_wait": "0.1m",
       "compression": "zstd", "write_policy": "write_back", "load_policy": "always",
       "eviction_policy": "fifo", "io_threads": 3, "o_direct": False, "metrics_port": None,
       "metrics_host": "::", "model": "org/m", "instance_id": "node-1", "share_refresh": "off",
       "share_writers": 7, "lease_timeout": "2.5s", "remote_url": "redis://h:6379/1",
       "remote_timeout": "10ms", "remote_retry": "0.1s", "remote_min_hits": 3,
       "remote_prefix": "kv:", "verify_sample": "1/3", "verify_tolerance": "0.0001",
       "verify_halt_after": 0}


@pytest.mark.parametrize(("key", "given", "shown"), [
    ("load_timeout", "1.1ms", "0.0011s"), ("share_refresh", "12345.678s", "12345.678s"),
    ("staging_wait", "0.1m", "6s"), ("disk_retry", "1d", "86400s"), ("remote_retry", "250ms", "0.25s"),
])
def test_durations_print_exactly(key, given, shown):
    config = load_config({key: given}, environ={})
    assert config.as_dict()[key] == shown
    assert getattr(load_config({key: shown}, environ={}), key) == getattr(config, key)


def test_every_printed_value_reads_back_to_the_same_config():
    from kvtier.cli.main import _shown

    assert set(ODD) == set(KEYS)
    config = load_config(ODD, environ={})
    printed = config.as_dict()
    assert load_config(printed, environ={}) == config  # --json
    environ = {"KVTIER_" + key.upper(): _shown(key, value) for key, value in printed.items()}
    assert load_config(environ=environ) == config  # the table, each value as a variable
    assert _shown("host_capacity", printed["host_capacity"]) == "1000000007"
    assert _shown("gpu_capacity", printed["gpu_capacity"]) == "1536MiB"
    assert _shown("disk_capacity", printed["disk_capacity"]) == "100GB"
    assert _shown("metrics_port", printed["metrics_port"]) == "off"


def test_the_table_shows_exact_values():
    import subprocess
    import sys

    clean = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    env = {**clean, "KVTIER_DISK_MIN_FREE": "0.5%", "KVTIER_LOAD_TIMEOUT": "1.1ms",
           "KVTIER_DISK_CAPACITY": "1000000007", "COLUMNS": "200"}
    result = subprocess.run([sys.executable, "-m", "kvtier.cli.main", "config"], env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    for shown in ("0.5%", "0.0011s", "1000000007", "4GiB"):
        assert f" {shown} " in result.stdout


# a given config that is not a mapping

@pytest.mark.parametrize("given", ["host_capacity=1GiB", [("host_capacity", "1GiB")], 5])
def test_a_given_config_must_be_a_mapping(given):
    message = config_error(given)
    assert "given config" in message and "a mapping of key to value" in message


def test_a_store_given_a_non_mapping_raises_a_config_error():
    from kvtier import KVStore
    from tests.helpers.kv import SMALL

    with pytest.raises(ConfigError, match="a mapping of key to value"):
        KVStore(SMALL, "host_capacity=1GiB", model="m")  # type: ignore[arg-type]


# small inconsistencies

@pytest.mark.parametrize(("key", "given", "expected"), [
    ("compression", "zstd ", "zstd"), ("write_policy", " write_back\n", "write_back"),
    ("load_policy", "\tALWAYS", "always"), ("eviction_policy", " fifo", "fifo"),
])
def test_enums_strip_whitespace(key, given, expected):
    assert load_config(environ={"KVTIER_" + key.upper(): given}).as_dict()[key] == expected


@pytest.mark.parametrize("given", ["1e1%", "1_0%", "-0%", "+5%", "\u0665%", "\uff15%", "5.%", ".5%",
                                   "5%%", "0x5%"])
def test_disk_min_free_is_a_plain_decimal_percentage(given):
    message = config_error({"disk_min_free": given})
    assert "'disk_min_free'" in message and "plain percentage" in message


@pytest.mark.parametrize("given", [0, 0.0, "0", "00", " 0 ", "off", "OFF", "", "none", None, False])
def test_metrics_port_none(given):
    assert load_config({"metrics_port": given}, environ={}).metrics_port is None
    assert "`off`" in doc_row("metrics_port")


def test_metrics_port_integral_float():
    assert load_config({"metrics_port": 9400.0}, environ={}).metrics_port == 9400


def test_an_unknown_key_without_a_suggestion_has_a_separator():
    message = config_error({"zzzzzz": 1})
    assert "unknown key 'zzzzzz' (given config); known keys: chunk_tokens, " in message
    message = config_error({"host_capacty": 1})
    assert "did you mean 'host_capacity'? Known keys: chunk_tokens, " in message


@pytest.mark.parametrize("url", ["mooncake://h:0", "mooncake://10.0.0.1:0?protocol=tcp"])
def test_mooncake_port_0_is_refused_as_redis_does(url):
    message = config_error({"remote_url": url})
    assert "'remote_url'" in message and "port 0 is no server's port" in message
    assert "port 0 is no server's port" in config_error({"remote_url": "redis://h:0/0"})


def test_a_mooncake_url_with_a_port_passes():
    assert load_config({"remote_url": "mooncake://h:50051"}, environ={}).remote_url == "mooncake://h:50051"


# duration minimums

@pytest.mark.parametrize(("key", "least", "below"), [
    ("disk_retry", "1ms", "0.999ms"), ("load_timeout", "1ms", "0.5ms"),
    ("staging_wait", "1ms", "0.0001ms"), ("share_refresh", "10ms", "9ms"),
    ("lease_timeout", "2s", "1.9s"), ("remote_timeout", "10ms", "9ms"),
    ("remote_retry", "100ms", "99ms"),
])
def test_every_duration_has_a_documented_minimum(key, least, below):
    assert load_config({key: least}, environ={}).as_dict()[key] != "off"
    message = config_error({key: below})
    assert f"'{key}'" in message and f"from {least} to" in message
    assert f"from `{least}` to" in doc_row(key)


@pytest.mark.parametrize(("key", "given"), [("disk_retry", 0.001), ("load_timeout", 0.1),
                                            ("share_refresh", "20ms"), ("staging_wait", "50ms")])
def test_small_durations_tests_use_still_pass(key, given):
    load_config({key: given}, environ={})
