import json

import pytest

from kvtier.config.settings import (
    KEYS,
    Compression,
    KVTierConfig,
    LoadPolicy,
    ODirect,
    WritePolicy,
    load_config,
)
from kvtier.errors import ConfigError


def test_defaults_without_any_source():
    config = load_config(environ={})
    assert config == KVTierConfig()
    assert config.chunk_tokens == 256
    assert config.host_capacity == 4 * 2**30
    assert config.disk_paths == ()
    assert config.compression is Compression.NONE
    assert config.write_policy is WritePolicy.WRITE_THROUGH
    assert config.load_policy is LoadPolicy.AUTO
    assert config.o_direct is ODirect.AUTO
    assert config.metrics_port is None
    assert config.model is None
    assert config.as_dict()["model"] == ""
    assert config.sources == {}


def test_every_key_parses_from_strings_as_from_env():
    env = {
        "KVTIER_CHUNK_TOKENS": "512", "KVTIER_GPU_CAPACITY": "1GiB",
        "KVTIER_HOST_CAPACITY": "512MiB", "KVTIER_DISK_CAPACITY": "100GB",
        "KVTIER_DISK_PATHS": "/mnt/a, /mnt/b", "KVTIER_DISK_MIN_FREE": "10%",
        "KVTIER_DISK_RETRY": "2m", "KVTIER_LOAD_TIMEOUT": "off", "KVTIER_STAGING_WAIT": "500ms",
        "KVTIER_COMPRESSION": "ZSTD",
        "KVTIER_WRITE_POLICY": "write_back", "KVTIER_LOAD_POLICY": "always",
        "KVTIER_EVICTION_POLICY": "fifo", "KVTIER_IO_THREADS": "16",
        "KVTIER_O_DIRECT": "false", "KVTIER_METRICS_PORT": "9400",
        "KVTIER_METRICS_HOST": "0.0.0.0", "KVTIER_MODEL": "org/m",
        "KVTIER_INSTANCE_ID": "node3-engine0", "KVTIER_SHARE_REFRESH": "250ms",
        "KVTIER_LEASE_TIMEOUT": "1m", "KVTIER_SHARE_WRITERS": "8",
        "KVTIER_REMOTE_URL": "redis+cluster://10.0.0.5:6379", "KVTIER_REMOTE_TIMEOUT": "250ms",
        "KVTIER_REMOTE_RETRY": "30s", "KVTIER_REMOTE_MIN_HITS": "2",
        "KVTIER_REMOTE_PREFIX": "tenant-a:kv:", "KVTIER_VERIFY_SAMPLE": "1/100",
        "KVTIER_VERIFY_TOLERANCE": "0.01", "KVTIER_VERIFY_HALT_AFTER": "5",
        "KVTIER_REMOTE_PASSWORD": "not a config key", "KVTIER_REMOTE_USERNAME": "kv",
    }
    config = load_config(environ=env)
    assert set(config.sources) == set(KEYS)
    assert config.as_dict() == {
        "chunk_tokens": 512, "gpu_capacity": 2**30, "host_capacity": 512 * 2**20,
        "disk_capacity": 100 * 10**9, "disk_paths": ["/mnt/a", "/mnt/b"], "disk_min_free": "10%",
        "disk_retry": "120s", "load_timeout": "off", "staging_wait": "0.5s", "compression": "zstd",
        "write_policy": "write_back", "load_policy": "always",
        "eviction_policy": "fifo", "io_threads": 16, "o_direct": "false", "metrics_port": 9400,
        "metrics_host": "0.0.0.0", "model": "org/m", "instance_id": "node3-engine0", "share_refresh": "0.25s",
        "lease_timeout": "60s", "share_writers": 8,
        "remote_url": "redis+cluster://10.0.0.5:6379", "remote_timeout": "0.25s",
        "remote_retry": "30s", "remote_min_hits": 2, "remote_prefix": "tenant-a:kv:",
        "verify_sample": 0.01, "verify_tolerance": 0.01, "verify_halt_after": 5,
    }
    assert config.sources["io_threads"] == "environment KVTIER_IO_THREADS"


def test_verify_sample_reads_a_share_as_a_number_a_percentage_or_a_fraction():
    for given, share in [(0.001, 0.001), ("0.1%", 0.001), ("1/1000", 0.001), ("off", 0.0),
                         (False, 0.0), (1, 1.0), ("100%", 1.0)]:
        assert load_config({"verify_sample": given}, environ={}).verify_sample == share, given
    for bad in ["2", "-1%", "1/0", "nan", True, "often"]:
        with pytest.raises(ConfigError, match=r"verify_sample.*0\.1% or 1/1000"):
            load_config({"verify_sample": bad}, environ={})
    assert load_config({"verify_tolerance": "AUTO"}, environ={}).verify_tolerance is None
    assert load_config({"verify_tolerance": 0}, environ={}).verify_tolerance == 0.0
    for bad in ["1.5", True, "loose"]:
        with pytest.raises(ConfigError, match="verify_tolerance"):
            load_config({"verify_tolerance": bad}, environ={})


def test_typed_values_from_a_mapping():
    config = load_config(
        {"disk_paths": ["/x"], "o_direct": True, "io_threads": 4, "metrics_port": 0},
        environ={},
    )
    assert config.disk_paths == ("/x",)
    assert config.o_direct is ODirect.ON
    assert config.metrics_port is None


def test_disk_paths_accept_a_json_list_string():
    assert load_config(environ={"KVTIER_DISK_PATHS": '["/a", "/b,c"]'}).disk_paths == ("/a", "/b,c")


def test_precedence_file_then_env_then_given(tmp_path):
    path = tmp_path / "kvtier.toml"
    path.write_text('host_capacity = "1GiB"\nio_threads = 2\nchunk_tokens = 128\n')
    env = {"KVTIER_CONFIG": str(path), "KVTIER_IO_THREADS": "3", "KVTIER_CHUNK_TOKENS": "64"}
    config = load_config({"chunk_tokens": 32}, environ=env)
    assert (config.host_capacity, config.io_threads, config.chunk_tokens) == (2**30, 3, 32)
    assert config.sources["host_capacity"] == f"file {path}"
    assert config.sources["chunk_tokens"] == "given config"


@pytest.mark.parametrize(("name", "text"), [
    ("c.toml", '[kvtier]\nhost_capacity = "2GiB"\n'),
    ("c.yaml", "host_capacity: 2GiB\n"),
    ("c.yml", "kvtier:\n  host_capacity: 2GiB\n"),
    ("c.json", json.dumps({"host_capacity": "2GiB"})),
])
def test_file_formats(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    assert load_config(environ={"KVTIER_CONFIG": str(path)}).host_capacity == 2 * 2**30


@pytest.mark.parametrize(("key", "value", "allowed"), [
    ("compression", "lz4", "none | zstd"),
    ("write_policy", "sometimes", "write_through | write_back"),
    ("load_policy", "never", "always | auto"),
    ("eviction_policy", "random", "lru | fifo"),
    ("o_direct", "maybe", "auto | true | false"),
    ("io_threads", 0, "1 to 256"),
    ("io_threads", 2.5, "1 to 256"),
    ("io_threads", True, "1 to 256"),
    ("chunk_tokens", -4, "positive integer"),
    ("host_capacity", "lots", "512MiB"),
    ("metrics_port", 70000, "1-65535"),
    ("metrics_host", "example.com", "an IP address to listen on"),
    ("metrics_host", "127.0.0.1:9400", "an IP address to listen on"),
    ("disk_paths", 7, "list of distinct directories"),
    ("disk_paths", ["/a", "/a"], "list of distinct directories"),
    ("disk_min_free", "120%", "percentage"),
    ("disk_min_free", "lots", "percentage"),
    ("staging_wait", "soon", "250ms or 1s"),
    ("staging_wait", "0s", "250ms or 1s"),
    ("instance_id", "../up", "letters, digits"),
    ("instance_id", ".hidden", "letters, digits"),
    ("instance_id", "a" * 65, "letters, digits"),
    ("instance_id", 7, "letters, digits"),
    ("share_refresh", "0s", "or off"),
    ("lease_timeout", "1s", "from 2s to 1d"),
    ("remote_url", "redis://user:pw@h:6379/0", "without credentials"),
    ("remote_url", "memcached://h:11211", "redis://host:port/db"),
    ("remote_url", "redis://:6379/0", "without credentials"),
    ("remote_url", 6379, "without credentials"),
    ("remote_timeout", "0s", "10ms to 60s"),
    ("remote_retry", "2d", "100ms to 1d"),
    ("remote_min_hits", -1, "integer from 0 to 1048576"),
    ("remote_prefix", "has space", "letters, digits"),
    ("remote_prefix", "", "letters, digits"),
    ("lease_timeout", "off", "from 2s to 1d"),
    ("share_writers", 0, "1 to 4096"),
])
def test_bad_values_name_the_key_and_allowed_values(key, value, allowed):
    with pytest.raises(ConfigError) as info:
        load_config({key: value}, environ={})
    message = str(info.value)
    assert f"'{key}'" in message and allowed in message and "given config" in message


def test_unknown_key_suggests_the_close_one():
    with pytest.raises(ConfigError, match=r"unknown key 'host_capacty'.*did you mean 'host_capacity'"):
        load_config({"host_capacty": "1GiB"}, environ={})


def test_unknown_environment_variable_is_an_error():
    with pytest.raises(ConfigError, match=r"unknown key 'disk_pth' \(environment KVTIER_DISK_PTH\)"):
        load_config(environ={"KVTIER_DISK_PTH": "/x"})


def test_reserved_variables_are_not_keys():
    assert load_config(environ={"KVTIER_LOG_LEVEL": "debug"}) == KVTierConfig()


def test_bad_file_value_names_the_file(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text('compression = "brotli"\n')
    with pytest.raises(ConfigError, match=f"'compression' \\(file {path}\\)"):
        load_config(environ={"KVTIER_CONFIG": str(path)})


@pytest.mark.parametrize(("name", "text", "match"), [
    ("c.ini", "x=1", "suffix '.ini'"),
    ("c.toml", "host_capacity = ", "cannot parse"),
    ("c.yaml", "a: [1,", "cannot parse"),
    ("c.json", "[1, 2]", "must hold a table"),
])
def test_bad_files_give_clear_errors(tmp_path, name, text, match):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigError, match=match):
        load_config(environ={"KVTIER_CONFIG": str(path)})


def test_missing_file_is_named(tmp_path):
    missing = tmp_path / "nope.toml"
    with pytest.raises(ConfigError, match=f"cannot read KVTIER_CONFIG file {missing}"):
        load_config(environ={"KVTIER_CONFIG": str(missing)})


def test_chunk_tokens_must_be_a_multiple_of_the_engine_block():
    config = load_config({"chunk_tokens": 96}, environ={})
    config.check_block_tokens(32)
    with pytest.raises(ConfigError, match=r"chunk_tokens=96 .*multiple of the engine's block size 64"):
        config.check_block_tokens(64)


@pytest.mark.parametrize(("given", "seconds"), [("45s", 45.0), ("0.5", 0.5), ("off", None)])
def test_disk_retry(given, seconds):
    assert load_config({"disk_retry": given}, environ={}).disk_retry == seconds


@pytest.mark.parametrize("bad", ["0s", "-1", "2d", "soon"])
def test_a_bad_disk_retry_is_named(bad):
    with pytest.raises(ConfigError, match=r"'disk_retry'.*allowed: a duration"):
        load_config({"disk_retry": bad}, environ={})


def test_a_bad_log_level_stops_start_up_naming_the_variable():
    with pytest.raises(ConfigError, match=r"bad value 'loud' for KVTIER_LOG_LEVEL; allowed: debug"):
        load_config(environ={"KVTIER_LOG_LEVEL": "loud"})
    assert load_config(environ={"KVTIER_LOG_LEVEL": "INFO"}) == KVTierConfig()


def test_the_log_level_sets_kvtiers_logger_and_shows_its_records():
    import logging

    from kvtier.logs import apply_log_level

    alone = logging.getLogger("kvtier-test-alone")
    alone.propagate = False  # nothing above it shows its records
    apply_log_level({}, alone)
    assert alone.level == logging.NOTSET and not alone.handlers  # unset: nothing changes
    apply_log_level({"KVTIER_LOG_LEVEL": "debug"}, alone)
    assert alone.level == logging.DEBUG and len(alone.handlers) == 1
    apply_log_level({"KVTIER_LOG_LEVEL": "debug"}, alone)
    assert len(alone.handlers) == 1  # once
    logging.getLogger("kvtier-test-shown").addHandler(logging.NullHandler())
    shown = logging.getLogger("kvtier-test-shown.child")  # its parent's handler shows it
    apply_log_level({"KVTIER_LOG_LEVEL": "debug"}, shown)
    assert shown.level == logging.DEBUG and not shown.handlers


def test_a_store_applies_the_log_level_at_start(monkeypatch):
    import logging

    from kvtier import KVStore
    from tests.helpers.kv import SMALL

    logger = logging.getLogger("kvtier")
    before = logger.level
    monkeypatch.setenv("KVTIER_LOG_LEVEL", "error")
    try:
        with KVStore(SMALL, {"chunk_tokens": 16, "host_capacity": "1MiB"}, model="m"):
            assert logger.level == logging.ERROR
    finally:
        logger.setLevel(before)  # clears the loggers' level caches too
