"""A remote store's URL: what it may say (a Redis URL only its host, port, db and the listed
TLS and protocol options), what is refused at config time, and that no message, log or
description ever repeats a credential, even of a URL refused for carrying one."""

import logging

import numpy as np
import pytest

from kvtier.config.redact import redacted
from kvtier.config.redis_url import parse_url
from kvtier.config.remote_url import check_url
from kvtier.config.settings import load_config
from kvtier.errors import ConfigError
from kvtier.io.result import IOStatus
from kvtier.keys import ChunkKey, Namespace
from kvtier.remote.redis_tier import PASSWORD_ENV, RedisTier
from tests.helpers.cli import run

SECRET = "hunter2"
NS = Namespace(model="m", kv_dtype="bfloat16", layout="l", block_tokens=16, chunk_tokens=256)
CARRYING_SECRETS = [
    f"redis://kvtier:{SECRET}@10.0.0.5:6379/0",
    f"redis://:{SECRET}@10.0.0.5:6379/0",
    f"redis://{SECRET}@10.0.0.5:6379/0",
    f"redis://127.0.0.1:6379/0?password={SECRET}",
    f"redis://127.0.0.1:6379/0?username=admin&password={SECRET}",
    f"redis://127.0.0.1:6379/0?pass%77ord={SECRET}",
    f"rediss://127.0.0.1:6379/0?ssl_password={SECRET}",
    f"redis+cluster://127.0.0.1:6379?password={SECRET}",
    f"redis://127.0.0.1:6379/0?{SECRET}",
    f"redis://127.0.0.1:6379/0#{SECRET}",
    f"redis://kvtier:pa/{SECRET}@10.0.0.5:6379/0",  # a password holding '/'
    f"redis://kvtier:pa?{SECRET}@10.0.0.5:6379/0",  # a password holding '?'
    f"mooncake://admin:{SECRET}@10.0.0.1:50051",
    f"mooncake://10.0.0.1:50051?metadata=http://admin:{SECRET}@10.0.0.2:8080/metadata",
    f"mooncake://10.0.0.1:50051?{SECRET}",
    f"valkey://kvtier:{SECRET}@10.0.0.5:6379",
    f"redis://kvtier:{SECRET}@10.0.0.5:abc/0",
    f"redis://default:{SECRET}/0",  # the '@host' forgotten: the password reads as a port
    f"redis://default:{SECRET}",
    f"redis://127.0.0.1:6379/{SECRET}",  # a password pasted where the database goes
    f"rediss+cluster://[::1]:{SECRET}/0",
    f"mooncake://admin:{SECRET}",
    f"mooncake://10.0.0.1:50051/{SECRET}",
]


@pytest.mark.parametrize("url", CARRYING_SECRETS)
def test_a_url_carrying_a_credential_is_refused_without_repeating_it(url):
    with pytest.raises(ConfigError) as refused:
        load_config(environ={"KVTIER_REMOTE_URL": url})
    assert SECRET not in str(refused.value) and SECRET not in repr(refused.value)
    with pytest.raises(ValueError) as direct:
        check_url(url)
    assert SECRET not in str(direct.value)
    assert SECRET not in redacted(url)


def test_an_option_kvtier_does_not_pass_on_is_named_and_credentials_pointed_to_the_environment():
    with pytest.raises(ConfigError) as refused:
        load_config({"remote_url": f"redis://127.0.0.1:6379/0?password={SECRET}"})
    message = str(refused.value)
    assert "'password'" in message and PASSWORD_ENV in message and SECRET not in message
    with pytest.raises(ConfigError, match="'socket_timeout'"):  # remote_timeout says it
        load_config({"remote_url": "redis://127.0.0.1:6379/0?socket_timeout=30"})


def test_a_redis_tier_refuses_a_url_with_a_credential_in_its_query():
    with pytest.raises(ValueError) as refused:
        RedisTier(f"redis://127.0.0.1:1/0?password={SECRET}", NS, 4096)
    assert SECRET not in str(refused.value)


@pytest.mark.parametrize(("url", "says"), [
    ("redis://127.0.0.1:abc/0", "port"),
    ("redis://127.0.0.1:63790000/0", "port"),
    ("redis://127.0.0.1:0/0", "port 0"),
    ("redis://127.0.0.1:6379/notadb", "database number"),
    ("redis://127.0.0.1:6379/0/1", "database number"),
    ("redis+cluster://127.0.0.1:6379/7", "only database 0"),
    ("redis://:6379/0", "no host"),
    ("redis://[::1/0", "IPv6"),
    ("redis://127.0.0.1:6379/0?ssl_ca_certs=/ca.pem", "needs TLS"),
    ("rediss://127.0.0.1:6379/0?ssl_cert_reqs=maybe", "none, optional or required"),
    ("rediss://127.0.0.1:6379/0?ssl_check_hostname=perhaps", "true or false"),
    ("rediss://127.0.0.1:6379/0?ssl_ca_certs=", "empty"),
    ("redis://127.0.0.1:6379/0?protocol=4", "2 or 3"),
    ("redis://127.0.0.1:6379/0?protocol=2&protocol=3", "twice"),
    ("redis://127.0.0.1:6379/0?db=3", "'db'"),
])
def test_a_malformed_redis_url_is_refused_at_config_time(url, says):
    with pytest.raises(ConfigError) as refused:
        load_config({"remote_url": url})
    assert says in str(refused.value)


def test_what_a_redis_url_says():
    plain = parse_url("redis://10.0.0.5:6380/3")
    assert (plain.host, plain.port, plain.db, plain.tls, plain.cluster, plain.client) == \
        ("10.0.0.5", 6380, 3, False, False, ())
    tls = parse_url("rediss+cluster://[::1]?ssl_ca_certs=/etc/kvtier/ca.pem&ssl_certfile=/c.pem"
                    "&ssl_keyfile=/k.pem&ssl_cert_reqs=required&ssl_check_hostname=false&protocol=3")
    assert (tls.host, tls.port, tls.db, tls.tls, tls.cluster) == ("::1", 6379, 0, True, True)
    assert dict(tls.client) == {"ssl_ca_certs": "/etc/kvtier/ca.pem", "ssl_certfile": "/c.pem",
                                "ssl_keyfile": "/k.pem", "ssl_cert_reqs": "required",
                                "ssl_check_hostname": False, "protocol": 3}
    assert parse_url("redis+cluster://h:7000/0").db == 0


@pytest.mark.parametrize(("url", "shown"), [
    ("redis://10.0.0.5:6379/0", "redis://10.0.0.5:6379/0"),
    ("rediss://h:1/0?ssl_keyfile=/k.pem&ssl_cert_reqs=none", "rediss://h:1/0?ssl_keyfile=***&ssl_cert_reqs=***"),
    (f"redis://u:{SECRET}@h:1/0", "redis://***@h:1/0"),
    (f"redis://h/0?{SECRET}#{SECRET}", "redis://h/0?***#***"),
    ("mooncake://m:50051?segment=4GiB", "mooncake://m:50051?segment=***"),
])
def test_a_url_is_shown_without_userinfo_or_query_values(url, shown):
    assert redacted(url) == shown


def test_a_tier_describes_and_logs_its_url_redacted(caplog, tmp_path):
    key = tmp_path / f"{SECRET}.pem"  # a TLS option's file must be there
    key.write_text("not read: nothing answers on port 1")
    url = f"rediss://127.0.0.1:1/0?ssl_keyfile={key}"
    tier = RedisTier(url, NS, 4096, timeout_s=0.2, retry_s=30)
    with caplog.at_level(logging.DEBUG, logger="kvtier"):
        (failed,) = tier.get_many([ChunkKey(b"k" * 16)], [np.zeros(4096, np.uint8)])
        (down,) = tier.get_many([ChunkKey(b"k" * 16)], [np.zeros(4096, np.uint8)])
    assert not failed.ok and down.status is IOStatus.PATH_DOWN
    shown = [tier.describe(), failed.detail, down.detail, caplog.text]
    assert "127.0.0.1:1" in tier.describe() and "127.0.0.1:1" in caplog.text
    assert not any(SECRET in text for text in shown), shown
    tier.close()


def test_the_cli_never_prints_a_credential_of_a_remote_url():
    for args, env in [(("inspect", f"redis://127.0.0.1:1/0?password={SECRET}"), {}),
                      (("inspect", f"redis://kvtier:{SECRET}@127.0.0.1:1/0"), {}),
                      (("config",), {"KVTIER_REMOTE_URL": f"redis://127.0.0.1:1/0?password={SECRET}"}),
                      (("config", "--json"), {"KVTIER_REMOTE_URL": f"mooncake://a:{SECRET}@h:1"}),
                      (("inspect", f"redis://default:{SECRET}/0"), {}),
                      (("inspect", f"redis://127.0.0.1:1/{SECRET}"), {}),
                      (("config",), {"KVTIER_REMOTE_URL": f"redis://default:{SECRET}/0"})]:
        result = run(*args, env=env)
        assert result.returncode != 0, (args, result.stdout)
        assert SECRET not in result.stdout + result.stderr, (args, result.stderr)
        assert "Traceback" not in result.stderr


@pytest.mark.parametrize("option", ["ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_ca_path"])
def test_a_tls_file_not_there_stops_the_start_naming_its_option_not_its_path(option, tmp_path):
    url = f"rediss://127.0.0.1:6380/0?{option}=/nonexistent/{SECRET}.pem"
    with pytest.raises(ConfigError, match=option) as refused:
        load_config({"remote_url": url}, environ={})
    assert SECRET not in str(refused.value)


def test_a_tls_file_of_the_wrong_kind_is_refused(tmp_path):
    ca = tmp_path / "ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----")
    with pytest.raises(ConfigError, match="ssl_ca_certs: its path is not a readable regular file"):
        load_config({"remote_url": f"rediss://h:1/0?ssl_ca_certs={tmp_path}"}, environ={})
    with pytest.raises(ConfigError, match="ssl_ca_path: its path is not a readable directory"):
        load_config({"remote_url": f"rediss://h:1/0?ssl_ca_path={ca}"}, environ={})
    assert load_config({"remote_url": f"rediss://h:1/0?ssl_ca_certs={ca}&ssl_ca_path={tmp_path}"},
                       environ={}).remote_url
