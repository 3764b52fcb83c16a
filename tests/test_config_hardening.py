"""Hostile and odd configuration values: each is a ``ConfigError`` naming the key, never a traceback."""

import json
import math
import os
import threading
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.config.settings import KEYS, KVTierConfig, load_config, read_config_file
from kvtier.errors import ConfigError
from kvtier.units import MAX_SIZE, parse_duration, parse_size

SIZE_KEYS = ("gpu_capacity", "host_capacity", "disk_capacity")
INT_KEYS = ("chunk_tokens", "io_threads", "metrics_port")
DURATION_KEYS = ("disk_retry", "load_timeout", "staging_wait")
DOCS = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"
HUGE_INT = pytest.param(10**5000, id="int-of-5001-digits")


def long(text: str) -> object:
    return pytest.param(text, id=f"{text[:6]}...({len(text)} chars)")


def config_error(overrides=None, environ=None) -> str:
    """The message of the ``ConfigError`` that loading this configuration raises."""
    with pytest.raises(ConfigError) as info:
        load_config(overrides, environ=environ or {})
    return str(info.value)


def deeply_nested(depth: int = 100_000) -> list:
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


def in_file(tmp_path, name: str, data: bytes) -> dict[str, str]:
    path = tmp_path / name
    path.write_bytes(data)
    return {"KVTIER_CONFIG": str(path)}


# 1. sizes: exact, whole bytes, at most 2**60

@pytest.mark.parametrize("key", SIZE_KEYS)
@pytest.mark.parametrize("text", [long("1" * 400), long("1" * 400 + "GiB"), long("1" * 400 + ".5KiB"),
                                  long("9" * 5000)])
def test_400_digit_size_is_a_config_error(key, text):
    message = config_error({key: text})
    assert f"'{key}'" in message and "given config" in message and "2**60" in message
    assert "allowed: a size" in message and len(message) < 600


@pytest.mark.parametrize("text", [long("1" * 400), long("1" * 400 + "GiB"), long("9" * 5000),
                                  long("0" * 5000 + "1" * 30)])
def test_parse_size_raises_only_value_error(text):
    with pytest.raises(ValueError, match=r"2\*\*60"):
        parse_size(text)


@pytest.mark.parametrize(("text", "expected"), [
    ("1.5GiB", 3 * 2**29), ("0.5KiB", 512), ("2.25MB", 2_250_000), ("9007199254740993", 2**53 + 1),
    (str(2**60), 2**60), ("1048576TiB", 2**60), (4294967296.0, 2**32),
    pytest.param("0" * 5000 + "7", 7, id="5000-zeros-then-7"),
    pytest.param("1." + "0" * 5000 + "GiB", 2**30, id="1.(5000-zeros)GiB"),
])
def test_sizes_are_exact(text, expected):
    assert parse_size(text) == expected
    assert load_config({"host_capacity": text}, environ={}).host_capacity == expected


@pytest.mark.parametrize("value", [1.5, "1.5", "0.3KiB", "1.0000000000000000000000001GiB", 0.5])
def test_fractional_bytes_are_an_error(value):
    message = config_error({"host_capacity": value})
    assert "whole number of bytes" in message and "'host_capacity'" in message


@pytest.mark.parametrize("value", [2**60 + 1, str(2**60 + 1), "1048577TiB", 1e300, float(2**61),
                                   HUGE_INT])
def test_size_above_1_eib_is_an_error(value):
    message = config_error({"disk_capacity": value})
    assert "'disk_capacity'" in message and len(message) < 600


@pytest.mark.parametrize("value", [-1, -1.0, "-1", math.nan, math.inf, -math.inf, "nan", "inf", True])
@pytest.mark.parametrize("key", [*SIZE_KEYS, "disk_min_free"])
def test_negative_nan_inf_sizes_are_errors(key, value):
    assert f"'{key}'" in config_error({key: value})


@pytest.mark.parametrize("value", [long("1" * 400), 1.5, "1.5", 2**60 + 1, "nan%", "inf%", "-5%"])
def test_disk_min_free_sizes_are_checked_too(value):
    assert "'disk_min_free'" in config_error({"disk_min_free": value})


# 2. integer keys and durations: no inf, nan or fractions

@pytest.mark.parametrize("key", INT_KEYS)
@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan, 2.5, "inf", "Infinity", "nan", "2.5",
                                   "1e3", HUGE_INT])
def test_int_keys_reject_inf_nan_and_fractions(key, value):
    message = config_error({key: value})
    assert f"'{key}'" in message and "given config" in message and "allowed:" in message


@pytest.mark.parametrize("key", INT_KEYS)
def test_json_infinity_in_a_file_is_a_config_error(tmp_path, key):
    environ = in_file(tmp_path, "c.json", f'{{"{key}": Infinity}}'.encode())
    assert f"'{key}' (file " in config_error(environ=environ)


def test_integral_floats_are_integers():
    config = load_config({"io_threads": 4.0, "chunk_tokens": 512.0, "metrics_port": 9400.0}, environ={})
    assert (config.io_threads, config.chunk_tokens, config.metrics_port) == (4, 512, 9400)
    assert isinstance(config.io_threads, int)


@pytest.mark.parametrize("value", [long("9" * 400), long("9" * 400 + "ms"), long("9" * 5000 + "w"),
                                   "inf", "nan", math.inf, math.nan])
def test_parse_duration_rejects_inf_nan_and_huge_numbers(value):
    with pytest.raises(ValueError):
        parse_duration(value)


@pytest.mark.parametrize("key", DURATION_KEYS)
@pytest.mark.parametrize("value", [math.inf, math.nan, long("9" * 5000), long("1" * 400 + "ms"), HUGE_INT])
def test_durations_reject_inf_nan_and_huge_numbers(key, value):
    message = config_error({key: value})
    assert f"'{key}'" in message and "allowed: a duration" in message and len(message) < 600


# 3. the config file: UTF-8, a regular file, at most 1 MiB, never blocking

def test_non_utf8_file_is_a_config_error(tmp_path):
    environ = in_file(tmp_path, "c.toml", b'compression = "zstd"\n# caf\xe9\n')
    assert "is not UTF-8 text" in config_error(environ=environ)


def test_fifo_config_file_does_not_block(tmp_path):
    fifo = tmp_path / "c.toml"
    os.mkfifo(fifo)
    errors: list[Exception] = []

    def load() -> None:
        try:
            load_config(environ={"KVTIER_CONFIG": str(fifo)})
        except Exception as exc:
            errors.append(exc)

    thread = threading.Thread(target=load, daemon=True)
    thread.start()
    thread.join(10)
    blocked = thread.is_alive()
    if blocked:  # a reader is stuck in open(): give it a writer that closes at once
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        thread.join(10)
    assert not blocked, "reading a FIFO as the config file blocked"
    assert len(errors) == 1 and isinstance(errors[0], ConfigError)
    assert "is not a regular file" in str(errors[0])


def test_directory_is_not_a_regular_file(tmp_path):
    (tmp_path / "conf.toml").mkdir()
    assert "is not a regular file" in config_error(environ={"KVTIER_CONFIG": str(tmp_path / "conf.toml")})


def test_device_is_not_a_regular_file(tmp_path):
    (tmp_path / "c.toml").symlink_to("/dev/null")
    assert "is not a regular file" in config_error(environ={"KVTIER_CONFIG": str(tmp_path / "c.toml")})


def test_missing_file_is_a_config_error(tmp_path):
    missing = str(tmp_path / "n.json")
    assert f"cannot read KVTIER_CONFIG file {missing}" in config_error(environ={"KVTIER_CONFIG": missing})


def test_file_over_1_mib_is_refused(tmp_path):
    environ = in_file(tmp_path, "c.toml", b'compression = "zstd"\n' + b"#" * (1 << 20) + b"\n")
    assert "larger than 1 MiB" in config_error(environ=environ)


def test_file_of_almost_1_mib_is_read(tmp_path):
    head = b'compression = "zstd"\n'
    environ = in_file(tmp_path, "c.toml", head + b"#" * ((1 << 20) - len(head) - 1) + b"\n")
    assert load_config(environ=environ).compression == "zstd"


@pytest.mark.parametrize(("name", "text"), [
    ("c.json", '{"disk_paths": ' + "[" * 100_000 + "]" * 100_000 + "}"),
    ("c.yaml", "disk_paths: " + "[" * 100_000 + "]" * 100_000 + "\n"),
    ("c.toml", "disk_paths = " + "[" * 100_000 + "]" * 100_000 + "\n"),
])
def test_deeply_nested_file_is_a_config_error(tmp_path, name, text):
    message = config_error(environ=in_file(tmp_path, name, text.encode()))
    assert "cannot parse" in message and len(message) < 600


@pytest.mark.parametrize("key", KEYS)
def test_deeply_nested_value_is_a_config_error(key):
    message = config_error({key: deeply_nested()})
    assert f"'{key}'" in message and len(message) < 1000


def test_yaml_alias_bomb_gives_a_short_message(tmp_path):
    levels = ["&a0 [x, x, x, x, x, x, x, x, x, x]"]
    levels += [f"&a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, 6)]
    text = "compression: [" + ", ".join(levels) + "]\n"  # 10**5 leaves, each written out by str()
    message = config_error(environ=in_file(tmp_path, "c.yaml", text.encode()))
    assert "'compression'" in message and len(message) < 2000


def test_yaml_that_is_not_a_mapping(tmp_path):
    assert "must hold a table" in config_error(environ=in_file(tmp_path, "c.yaml", b"- a\n- b\n"))


def test_read_config_file_reads_a_plain_file(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"kvtier": {"io_threads": 3}}))
    assert read_config_file(path) == {"io_threads": 3}


# 4. disk paths: normalised, absolute, distinct after normalisation

@pytest.mark.parametrize("paths", [
    ["/x", "/x/"], ["/x", "/x/."], ["/x", "/y/../x"], ["/x", "//x"], ["/x", "///x//"], ["d", "./d"],
    "/x, /x/",
])
def test_two_spellings_of_one_path_are_an_error(tmp_path, monkeypatch, paths):
    monkeypatch.chdir(tmp_path)
    message = config_error({"disk_paths": paths})
    first, second = (p.strip() for p in (paths.split(",") if isinstance(paths, str) else paths))
    assert "'disk_paths'" in message and repr(first) in message and repr(second) in message


def test_relative_and_absolute_spellings_are_one_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    message = config_error({"disk_paths": [str(tmp_path / "d"), "d"]})
    assert "'disk_paths'" in message and "'d'" in message


def test_paths_are_stored_normalised_and_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "target").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "target")
    config = load_config({"disk_paths": ["/a/b/", "rel", "link", "/c/./d/../e"]}, environ={})
    assert config.disk_paths == ("/a/b", str(tmp_path / "rel"), str(tmp_path / "link"), "/c/e")


@pytest.mark.parametrize("paths", [["/a", ""], ["/a", "  "], "/a,,/b", "/a, ", ["/a\0b"], "/a\x00",
                                   '["/a", ""]'])
def test_empty_entry_or_nul_is_an_error(paths):
    assert "'disk_paths'" in config_error({"disk_paths": paths})


@pytest.mark.parametrize("paths", ["", "  ", [], ()])
def test_no_paths_means_no_disk_tier(paths):
    assert load_config({"disk_paths": paths}, environ={}).disk_paths == ()


# 5. the model key

def test_model_defaults_to_none():
    config = load_config(environ={})
    assert config.model is None and KVTierConfig().model is None
    assert config.as_dict()["model"] == ""
    json.dumps(config.as_dict())


def test_model_from_each_source(tmp_path):
    environ = in_file(tmp_path, "c.toml", b'model = "from/file"\n')
    assert load_config(environ=environ).model == "from/file"
    assert load_config(environ={**environ, "KVTIER_MODEL": "from/env"}).sources["model"] == (
        "environment KVTIER_MODEL"
    )
    config = load_config({"model": "Qwen/Qwen3-0.6B"}, environ={**environ, "KVTIER_MODEL": "x"})
    assert (config.model, config.sources["model"]) == ("Qwen/Qwen3-0.6B", "given config")
    assert json.loads(json.dumps(config.as_dict()))["model"] == "Qwen/Qwen3-0.6B"


@pytest.mark.parametrize("name", ["m", "x" * 512, "My Model 7B (int8)", "模型/名前"])
def test_good_model_names(name):
    assert load_config({"model": name}, environ={}).model == name


@pytest.mark.parametrize("name", ["", "   ", "a\0b", "x" * 513, "a\nb", "a\x1bb", 7, ["m"], True, b"m"])
def test_bad_model_names(name):
    message = config_error({"model": name})
    assert "'model'" in message and "printable characters" in message and len(message) < 600


def test_model_is_documented():
    row = next(line for line in DOCS.read_text().splitlines() if line.startswith("| `model` |"))
    assert "KVStore(model=...)" in row and "ignored in vLLM" in row


# 6. odd environment values, odd keys, odd types

@pytest.mark.parametrize("key", [*INT_KEYS, *SIZE_KEYS, *DURATION_KEYS, "disk_min_free"])
def test_huge_environment_values_give_our_message(key):
    variable = "KVTIER_" + key.upper()
    message = config_error(environ={variable: "9" * 5000})
    assert message.startswith("kvtier config: bad value '999")
    assert f"'{key}' (environment {variable})" in message and "allowed:" in message
    assert len(message) < 600


@pytest.mark.parametrize("value", ["\uff11\uff12", "\u0663", "4\x00", "\udcff", "0x10", "1_6", "+", " "])
def test_weird_environment_integers_are_errors(value):
    message = config_error(environ={"KVTIER_IO_THREADS": value})
    assert "'io_threads' (environment KVTIER_IO_THREADS)" in message


class LooksLikeAKey:
    def __str__(self) -> str:
        return "io_threads"


@pytest.mark.parametrize("key", [1, None, ("io_threads",), b"io_threads", LooksLikeAKey()])
def test_non_string_key_is_a_config_error(key):
    message = config_error({key: 2})
    assert "is not a string" in message and "given config" in message and "io_threads" in message


def test_non_string_key_in_a_yaml_file(tmp_path):
    assert "is not a string" in config_error(environ=in_file(tmp_path, "c.yaml", b"1: 2\n"))


@pytest.mark.parametrize("key", KEYS)
@pytest.mark.parametrize("value", [object(), {"a": 1}, b"12", HUGE_INT, math.nan, [["x"]]])
def test_every_key_rejects_odd_types(key, value):
    message = config_error({key: value})
    assert f"'{key}'" in message and "allowed:" in message


VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text() | st.binary(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=4),
    max_leaves=12,
)
EDGES = st.sampled_from([math.inf, -math.inf, math.nan, 0.5, 1.5, -1.0, 2**60 + 1, 10**400, "1" * 400,
                         "9" * 5000, "", " ", "\0", "[" * 5000, "1.5", "inf", "nan", "-0", "1e3"])


@settings(max_examples=400, deadline=None)
@given(key=st.sampled_from(KEYS), value=EDGES | st.floats() | VALUES)
def test_any_given_value_parses_or_is_a_config_error(key, value):
    try:
        load_config({key: value}, environ={})
    except ConfigError as exc:
        assert f"'{key}'" in str(exc) and len(str(exc)) < 2000


@settings(max_examples=400, deadline=None)
@given(key=st.sampled_from(KEYS),
       text=EDGES.filter(lambda v: isinstance(v, str)) | st.text(max_size=60)
       | st.from_regex(r"\A[0-9.]{1,600}[a-zA-Z%]{0,3}\Z"))
def test_any_environment_text_parses_or_is_a_config_error(key, text):
    try:
        config = load_config(environ={"KVTIER_" + key.upper(): text})
    except ConfigError as exc:
        assert f"'{key}' (environment KVTIER_{key.upper()})" in str(exc)
    else:
        json.dumps(config.as_dict())
        if key in SIZE_KEYS:
            assert 0 <= getattr(config, key) <= MAX_SIZE
