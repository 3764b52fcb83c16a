"""A hostile cache directory: nothing outside the root is touched, nothing kvtier did not
write is deleted, special files never block, bad entries become a path out of service or a
clean CLI error. Each test names the finding of the hardening issue it reproduces."""

import json
import os
import subprocess
import sys

import pytest

from kvtier import KVStore
from kvtier.keys import namespace_id_of
from tests.conftest import SMALL, make_kv
from tests.hostile import cli, make_cache, make_decoy, time_bound, tree_digest
from tests.test_disk_store import STRIDE, config, exact, seq


@pytest.fixture
def cache(tmp_path):
    """(cache root, its one namespace directory, a decoy tree outside the root)."""
    root = tmp_path / "cache"
    return root, make_cache(root), make_decoy(tmp_path / "decoy")


def data(code_output):
    code, output = code_output
    return code, json.loads(output[output.index("{"):])


# -- finding 1: deleting what kvtier did not write ------------------------------------------


def test_finding1_clear_and_gc_leave_directories_kvtier_did_not_write(cache):
    root, ns, _ = cache
    mine = root / "my-project"
    mine.mkdir()
    (mine / "namespace.json").write_text("{}")
    (mine / "slots-0001.kvt").write_bytes(b"mine")
    fake = root / ("ab" * 16)  # a namespace-like name whose metadata is not kvtier's
    fake.mkdir(mode=0o700)
    (fake / "namespace.json").write_text(json.dumps({"namespace": "{}", "stride": 8192,
                                                     "raw_bytes": 4096, "file_slots": 1}))
    (fake / "notes.txt").write_text("keep me")
    before = tree_digest(mine), tree_digest(fake)
    code, report = data(cli("gc", root, "--stale", "--json"))
    assert code == 0 and not report["namespaces_removed"]  # damaged metadata: not stale
    code, report = data(cli("clear", root, "--yes", "--json"))
    assert code == 1 and report["removed"] == [ns.name] and fake.name in report["left"]
    assert (tree_digest(mine), tree_digest(fake)) == before and not ns.exists()


def test_finding1_clear_removes_only_kvtier_files_of_a_namespace(cache):
    root, ns, _ = cache
    (ns / "operator-notes.txt").write_text("keep me")
    code, report = data(cli("clear", root, "--yes", "--json"))
    assert code == 1 and report["left"] == {ns.name: ["operator-notes.txt"]}
    assert sorted(p.name for p in ns.iterdir()) == ["operator-notes.txt"]


def test_finding1_an_empty_path_is_refused_not_the_current_directory(cache):
    root, ns, _ = cache
    result = subprocess.run([sys.executable, "-m", "kvtier.cli.main", "clear", "", "--yes"],
                            cwd=root, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "PATH is empty" in result.stderr
    assert ns.exists()


# -- finding 2: writing outside the root through symlinks -----------------------------------


@pytest.mark.parametrize("name", ["namespace.json", "index.kvt", "slots-0000.kvt", "lock",
                                  ".o_direct_probe"])
def test_finding2_a_symlink_in_a_namespace_never_leads_outside(cache, name):
    root, ns, decoy = cache
    target = decoy / "precious.txt"
    if (ns / name).exists():
        (ns / name).unlink()
    (ns / name).symlink_to(target)
    before = tree_digest(decoy)
    with KVStore(SMALL, config(root)) as store:
        store.put(seq(500, 2), make_kv(seq(500, 2)))
        store.flush()
        exact(store, seq(500, 2))
        if name in ("index.kvt", "slots-0000.kvt", "lock"):
            (reason,) = store.disk.down_paths.values()
            assert "symlink" in reason
    for args in (["inspect", root], ["verify", root], ["verify", root, "--repair"],
                 ["gc", root, "--older-than", "0s"], ["gc", root, "--stale"],
                 ["clear", root, "--yes"]):
        cli(*args)
    assert tree_digest(decoy) == before and oct(target.stat().st_mode)[-3:] == "644"


def test_finding2_a_symlinked_namespace_directory_is_never_opened(cache):
    root, ns, decoy = cache
    victim = decoy / "dir"
    before = tree_digest(decoy)
    os.rename(ns, root.parent / "moved")
    ns.symlink_to(victim)
    with KVStore(SMALL, config(root)) as store:
        assert "symlink" in next(iter(store.disk.down_paths.values()))
    cli("clear", root, "--yes")
    assert tree_digest(decoy) == before


def test_finding2_hard_links_to_files_elsewhere_are_refused(cache):
    root, ns, decoy = cache
    (ns / "index.kvt").unlink()
    os.link(decoy / "precious.txt", ns / "index.kvt")
    before = tree_digest(decoy)
    with KVStore(SMALL, config(root)) as store:
        assert "hard links" in next(iter(store.disk.down_paths.values()))
    cli("verify", root, "--repair")
    cli("clear", root, "--yes")
    assert tree_digest(decoy) == before


# -- finding 5: verify --repair on edited metadata ------------------------------------------


def edit_meta(ns, **changes):
    meta = json.loads((ns / "namespace.json").read_text())
    (ns / "namespace.json").write_text(json.dumps({**meta, **changes}))


def recovered(root):
    with KVStore(SMALL, config(root)) as store:
        return store.stats().recovered_chunks


def test_finding5_repair_never_blanks_slots_when_the_stride_was_edited(cache):
    root, ns, _ = cache
    slots = (ns / "slots-0000.kvt").read_bytes()
    edit_meta(ns, stride=2 * STRIDE)
    code, report = data(cli("verify", root, "--repair", "--json"))
    assert code == 1 and "stride" in report["namespaces"][0]["problem"]
    assert (ns / "slots-0000.kvt").read_bytes() == slots and recovered(root) == 3


def test_finding5_repair_refuses_when_slots_disagree_with_the_metadata(cache):
    root, ns, _ = cache
    slots = (ns / "slots-0000.kvt").read_bytes()
    raw = json.loads((ns / "namespace.json").read_text())["raw_bytes"]
    edit_meta(ns, raw_bytes=raw + 4096, stride=STRIDE + 4096,  # consistent, but wrong
              file_slots=(8 << 30) // (STRIDE + 4096))
    code, report = data(cli("verify", root, "--repair", "--json"))
    (found,) = report["namespaces"]
    assert code == 1 and found["mismatched"] and "not repaired" in found["problem"]
    assert (ns / "slots-0000.kvt").read_bytes() == slots and recovered(root) == 3


# -- findings 6 and 7: special files where kvtier expects its own ---------------------------


@pytest.mark.parametrize("name", ["lock", "index.kvt", "namespace.json", "slots-0000.kvt"])
@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_finding6_7_special_files_never_block_and_take_the_path_out(cache, name, kind):
    root, ns, _ = cache
    if (ns / name).exists():
        (ns / name).unlink()
    os.mkfifo(ns / name) if kind == "fifo" else (ns / name).mkdir()
    with time_bound(30, "KVStore()"), KVStore(SMALL, config(root)) as store:
        store.put(seq(800, 1), make_kv(seq(800, 1)))
        assert exact(store, seq(800, 1)) == 16
        down = store.disk.down_paths
    if name == "namespace.json" and kind == "fifo":
        assert not down  # replaced by a real file, atomically
    else:
        assert down and ("FIFO" in str(down) or "directory" in str(down))
    for args in (["inspect", root], ["verify", root], ["verify", root, "--repair"],
                 ["gc", root, "--older-than", "0s"], ["gc", root, "--stale"],
                 ["clear", root, "--yes"]):
        cli(*args)


# -- finding 8: malformed metadata and names ------------------------------------------------


@pytest.mark.parametrize("meta", ["[1, 2]", '{"stride": 0}', '{"stride": "abc"}', "{}",
                                  "not json", '{"namespace": "[]"}', "\xff\xfe"])
def test_finding8_malformed_metadata_is_a_clean_report(cache, meta):
    root, ns, _ = cache
    (ns / "namespace.json").write_bytes(meta.encode("latin-1"))
    code, report = data(cli("inspect", root, "--json"))
    assert code == 1 and report["namespaces"][0]["status"] == "damaged"
    assert cli("verify", root)[0] == 1
    assert cli("verify", root, "--repair")[0] == 1
    assert cli("gc", root, "--stale", "--older-than", "0s")[0] == 0
    assert len(list(ns.glob("slots-*.kvt"))) == 1  # damaged metadata is no reason to delete


def test_finding8_odd_names_and_kinds_are_clean(cache):
    root, ns, _ = cache
    (root / "not-hex-at-all").mkdir()
    (root / "not-hex-at-all" / "namespace.json").write_text("{}")
    (ns / "slots-abc.kvt").write_bytes(b"x")
    (ns / "index.kvt").unlink()
    (ns / "index.kvt").mkdir()
    _code, report = data(cli("inspect", root, "--json"))
    assert [n["id"] for n in report["namespaces"]] == [ns.name]
    for args in (["verify", root], ["verify", root, "--repair"], ["gc", root, "--older-than", "0s"],
                 ["clear", root, "--yes"]):
        cli(*args)
    assert (root / "not-hex-at-all" / "namespace.json").exists() and (ns / "slots-abc.kvt").exists()


# -- finding 9: bounded reads ---------------------------------------------------------------


def test_finding9_a_huge_sparse_index_is_not_read_whole(cache):
    root, ns, _ = cache
    os.truncate(ns / "index.kvt", 8 << 30)
    code = ("import resource, sys; from typer.testing import CliRunner; "
            "from kvtier.cli.main import app; "
            f"r = CliRunner().invoke(app, ['inspect', {str(root)!r}, '--json']); "
            "print(r.exit_code, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120)
    exit_code, max_rss_kib = map(int, result.stdout.split()[-2:])
    assert exit_code == 0 and max_rss_kib < 1 << 20, result.stdout  # under 1 GiB, not 8


def test_finding9_verify_of_a_huge_sparse_slot_file_is_bounded(cache):
    root, ns, _ = cache
    os.truncate(ns / "slots-0000.kvt", 100 << 30)
    code, report = data(cli("verify", root, "--json", bound=60))
    (found,) = report["namespaces"]
    assert code == 0 and found["ok"] == 3 and found["slots"] * STRIDE <= (8 << 30) + STRIDE


def test_finding9_a_disk_too_large_to_track_is_a_config_error(tmp_path):
    from kvtier.errors import ConfigError

    with pytest.raises(ConfigError, match="raise chunk_tokens or lower disk_capacity"):
        KVStore(SMALL, config(tmp_path, disk_chunks=1, disk_capacity="1TiB"))


# -- finding 15: exit codes and figures -----------------------------------------------------


def test_finding15_inspect_of_a_truncated_slot_file_is_at_most_full(cache):
    root, ns, _ = cache
    os.truncate(ns / "slots-0000.kvt", STRIDE)
    code, report = data(cli("inspect", root, "--json"))
    (found,) = report["namespaces"]
    assert code == 0 and found["slots"] == 1 and found["chunks"] <= 1 and found["fill"] <= 1.0
    assert found["bad_index_entries"] == 2


def test_a_stale_namespace_proven_by_its_metadata_is_reclaimed(cache):
    root, _ns, _ = cache
    described = json.dumps({"format_version": 99, "model": "old"})
    old = root / namespace_id_of(described)
    old.mkdir(mode=0o700)
    (old / "namespace.json").write_text(json.dumps({"namespace": described, "stride": 8192,
                                                    "raw_bytes": 4096, "file_slots": 10}))
    code, report = data(cli("gc", root, "--stale", "--json"))
    assert code == 0 and report["namespaces_removed"] == [old.name] and not old.exists()
    assert recovered(root) == 3
