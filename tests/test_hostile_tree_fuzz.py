"""Random hostile trees under a cache root: symlinks in and out, FIFOs, directories where files
are expected, hard links, sparse, truncated and garbage files, in a namespace directory, its
``writers/`` directory and a writer's segment. On each, a store and every CLI
command run with a time bound: no exception escapes, every exit code is a documented one,
nothing outside the root changes, and the store never serves a wrong byte."""

import json
import os
import shutil

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier import KVStore
from tests.helpers.hostile import cli, make_cache, make_decoy, segment_dir, time_bound, tree_digest
from tests.helpers.kv import SMALL, make_kv
from tests.helpers.store import config, load, seq

# Entries to spoil, relative to the namespace directory; SEGMENT stands for the writer's one.
SEGMENT = "writers/<writer>"
NAMES = ["namespace.json", ".namespace.json.tmp-1", "writers", SEGMENT, "writers/w-9",
         "writers/not a writer"] + [
    f"{SEGMENT}/{name}" for name in ("index.kvt", "slots-0000.kvt", "slots-0001.kvt", "lock",
                                     "lease", "log.kvt", ".o_direct_probe", "slots-9999.kvt",
                                     ".lease.tmp-1-0123abcd")]
KINDS = ["link-out-file", "link-out-dir", "link-in", "dangling", "fifo", "directory",
         "hard-link-out", "sparse", "truncated", "garbage", "json-list", "json-bad-numbers",
         "flip"]
ROOT_ENTRIES = ["link-namespace-out", "fifo-namespace", "foreign-dir", "file-namespace"]

damage = st.lists(st.tuples(st.sampled_from(NAMES), st.sampled_from(KINDS),
                            st.integers(0, 1 << 34)), max_size=4)
extras = st.lists(st.sampled_from(ROOT_ENTRIES), max_size=2, unique=True)


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    """A cache root with one namespace of 3 chunks, made once and copied for each example."""
    root = tmp_path_factory.mktemp("template") / "cache"
    make_cache(root)
    return root


def inside(path, top):
    """True when every directory from ``top`` down to ``path``'s parent is a real one (no
    link, no file): spoiling ``path`` then changes nothing outside the root."""
    parent = path.parent
    while parent != top:
        if parent.is_symlink() or not parent.is_dir():
            return False
        parent = parent.parent
    return True


def spoil(ns, segment, decoy, name, kind, number):
    """Replace (or add) entry ``name`` of the namespace with something hostile."""
    path = ns / name.replace(SEGMENT, f"writers/{segment.name}")
    if not inside(path, ns):
        return
    original = path.read_bytes() if path.is_file() and not path.is_symlink() else b""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()
    if kind == "link-out-file":
        path.symlink_to(decoy / "precious.txt")
    elif kind == "link-out-dir":
        path.symlink_to(decoy / "dir")
    elif kind == "link-in":
        path.symlink_to(segment / "lock")
    elif kind == "dangling":
        path.symlink_to(decoy / "nothing-here")
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
        (path / "inner").write_bytes(b"x")
    elif kind == "hard-link-out":
        os.link(decoy / "precious.txt", path)
    elif kind == "sparse":
        path.write_bytes(original[:4096])
        os.truncate(path, number)
    elif kind == "truncated":
        path.write_bytes(original[: number % (len(original) + 1)])
    elif kind == "garbage":
        path.write_bytes(os.urandom(number % 20000))
    elif kind == "json-list":
        path.write_text(json.dumps([number, "x"]))
    elif kind == "json-bad-numbers":
        path.write_text(json.dumps({"namespace": "{}", "stride": -number, "raw_bytes": 1e308,
                                    "file_slots": "many"}))
    else:  # flip
        data = bytearray(original or b"\0" * 64)
        data[number % len(data)] ^= 0xFF
        path.write_bytes(bytes(data))


def add_root_entry(root, ns, decoy, kind):
    name = f"{ROOT_ENTRIES.index(kind):x}" * 32  # a namespace-like name of its own
    if kind == "link-namespace-out":
        (root / name).symlink_to(decoy / "dir")
    elif kind == "fifo-namespace":
        os.mkfifo(root / name)
    elif kind == "file-namespace":
        (root / name).write_bytes(b"not a directory")
    else:
        (root / "my-data").mkdir()
        (root / "my-data" / "namespace.json").write_text("{}")
        (root / "my-data" / "slots-0000.kvt").write_bytes(b"mine")


def check_store(root):
    """Open the store on the damaged root, store and load: right bytes or a miss."""
    with time_bound(60, "KVStore on a hostile tree"), KVStore(SMALL, config(root)) as store:
        for tokens in (seq(0, 3), seq(7000, 2)):
            n, got = load(store, tokens)
            assert torch_equal(got, make_kv(tokens)[:, :, :n]), "wrong bytes served"
        store.put(seq(7000, 2), make_kv(seq(7000, 2)))
        store.flush()
        n, got = load(store, seq(7000, 2))
        assert n == 2 * 16 and torch_equal(got, make_kv(seq(7000, 2)))


def torch_equal(a, b):
    from tests.helpers.kv import same_bytes

    return same_bytes(a, b)


@settings(max_examples=100, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(damage=damage, extras=extras)
def test_no_hostile_tree_escapes_hangs_or_serves_wrong_bytes(template, tmp_path, damage, extras):
    work = tmp_path / f"example-{os.urandom(4).hex()}"
    root, decoy = work / "cache", make_decoy(work / "decoy")
    shutil.copytree(template, root, symlinks=True)
    segment = segment_dir(root)
    ns = segment.parent.parent
    for name, kind, number in damage:
        spoil(ns, segment, decoy, name, kind, number)
    for kind in extras:
        add_root_entry(root, ns, decoy, kind)
    before = tree_digest(decoy)
    try:
        check_store(root)
        for args in (["inspect", root, "--json"], ["verify", root], ["verify", root, "--repair"],
                     ["gc", root, "--older-than", "0s", "--stale"], ["clear", root, "--yes"]):
            cli(*args, bound=60)
        assert tree_digest(decoy) == before, "something outside the root changed"
    finally:
        shutil.rmtree(work, ignore_errors=True)
