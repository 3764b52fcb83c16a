"""Which mount a path is under, from the mount table alone (``kvtier.io.mounts.mount_of``):
how a question of a hung mount's path knows the mount was made anew there."""

from kvtier.io.mounts import mount_of, mounts_of

TABLE = """\
22 1 0:21 / / rw - overlay overlay rw
27 22 8:1 / /work rw - ext4 /dev/sda1 rw
30 27 0:40 / /work/cache rw - nfs server:/export rw
31 27 0:41 / /work/cache rw - nfs server:/export rw
32 27 0:42 / /work/my\\040cache rw - fuse.x x rw
not a line of the table
"""


def test_the_longest_mount_point_over_a_path_is_its_mount_the_last_of_equals_on_top(tmp_path):
    table = tmp_path / "mountinfo"
    table.write_text(TABLE)
    where = str(table)
    assert mount_of("/work/cache/ns/writers", where) == 31  # mounted on top of 30
    assert mount_of("/work/cache", where) == 31
    assert mount_of("/work/cachet", where) == 27  # not under /work/cache
    assert mount_of("/work/my cache/x", where) == 32  # a space, escaped in the table
    assert mount_of("/etc", where) == 22
    assert mount_of("/work/./cache/../cache", where) == 31  # made absolute, no symlink followed
    assert mounts_of(["/work/cache/ns", "/etc", "/work/my cache"], where) == [31, 22, 32]


def test_no_table_no_mount(tmp_path):
    assert mount_of("/work", str(tmp_path / "none")) is None


def test_this_processs_table_names_a_mount_for_any_path(tmp_path):
    assert mount_of(str(tmp_path)) is not None


def test_a_path_fell_through_once_its_mount_is_gone_not_while_it_or_a_deeper_one_is_there(tmp_path):
    from kvtier.io.mounts import fell_through

    table = tmp_path / "mountinfo"
    table.write_text(TABLE)
    where = str(table)
    assert fell_through("/work/cache/ns", "/work/cache", where) is None  # still mounted
    assert fell_through("/work/cache/ns", "/", where) is None  # a mount put over it: not lower
    assert fell_through("/work/cache/ns", None, where) is None  # never opened: cannot tell
    table.write_text(TABLE.replace("30 27 0:40 / /work/cache", "30 27 0:40 / /elsewhere")
                     .replace("31 27 0:41 / /work/cache", "31 27 0:41 / /elsewhere2"))
    assert fell_through("/work/cache/ns", "/work/cache", where) == "/work"  # on the disk beneath
