import os

import pytest

from fasttomo.data.io import OutputExistsError
from fasttomo.data.io.atomic import WriteFailed, atomic_write


def _text(s):
    def w(tmp):
        with open(tmp, "w") as f:
            f.write(s)
    return w


def test_writes_and_refuses_existing(tmp_path):
    p = tmp_path / "a.txt"
    atomic_write(p, _text("one"))
    assert p.read_text() == "one"
    with pytest.raises(OutputExistsError, match=r"a\.txt.*output\.overwrite=true"):
        atomic_write(p, _text("two"))
    assert p.read_text() == "one"
    atomic_write(p, _text("two"), overwrite=True)
    assert p.read_text() == "two"
    assert sorted(os.listdir(tmp_path)) == ["a.txt"]  # no temporary files left


def test_crash_leaves_nothing(tmp_path):
    p = tmp_path / "b.txt"

    def boom(tmp):
        with open(tmp, "w") as f:
            f.write("half")
        raise RuntimeError("crash mid-write")

    with pytest.raises(WriteFailed, match="RuntimeError: crash mid-write") as info:  # any failure: a write failure
        atomic_write(p, boom)
    assert isinstance(info.value, OSError) and isinstance(info.value.__cause__, RuntimeError)
    assert os.listdir(tmp_path) == []
    atomic_write(p, _text("old"))
    with pytest.raises(WriteFailed):
        atomic_write(p, boom, overwrite=True)
    assert p.read_text() == "old" and os.listdir(tmp_path) == ["b.txt"]


def test_creates_missing_folder(tmp_path):
    p = tmp_path / "sub" / "c.txt"
    atomic_write(p, _text("x"))
    assert p.read_text() == "x"


def test_written_files_get_the_usual_permissions(tmp_path):
    """Temporary files are private (0600); the result must carry the mode open() would give."""
    import os

    from fasttomo.data.io.atomic import atomic_write

    old = os.umask(0o022)
    try:
        out = atomic_write(tmp_path / "r.txt", lambda t: open(t, "w").write("x"))
    finally:
        os.umask(old)
    assert os.stat(out).st_mode & 0o777 == 0o644


def test_a_write_published_later_is_named_only_once_on_the_disk(tmp_path):
    """With ``later``: the writer's file is complete and readable at the pending publish's tmp,
    the destination appears (with a plain open()'s mode) only when the thread has fsync'ed and
    renamed it; the ranges handed over on the way change nothing."""
    p, later, opened = tmp_path / "v.bin", [], []

    def w(tmp):
        with open(tmp, "wb") as f:
            f.write(b"x" * 5000)
        later[-1].written(0, 4096)
        later[-1].written(4096, 904)
        opened.append(open(tmp, "rb"))  # opened inside the writer: the rename may come at once after it

    assert atomic_write(p, w, later=later) == str(p)
    (pending,) = later
    with opened[0] as f:
        assert f.read() == b"x" * 5000  # readable before or after the rename
    assert pending.join() == str(p) and p.read_bytes() == b"x" * 5000
    assert sorted(os.listdir(tmp_path)) == ["v.bin"] and pending.seconds >= 0
    mask = os.umask(0)
    os.umask(mask)
    assert os.stat(p).st_mode & 0o777 == 0o666 & ~mask


def test_a_failed_write_published_later_leaves_nothing(tmp_path):
    p, later = tmp_path / "v.bin", []
    p.write_text("old")

    def boom(tmp):
        with open(tmp, "w") as f:
            f.write("half")
        raise RuntimeError("crash mid-write")

    with pytest.raises(WriteFailed, match="crash mid-write"):
        atomic_write(p, boom, overwrite=True, later=later)
    assert later == [] and os.listdir(tmp_path) == ["v.bin"] and p.read_text() == "old"


def test_a_destination_that_appears_meanwhile_is_kept_and_the_join_says_so(tmp_path):
    p, later = tmp_path / "v.bin", []

    def w(tmp):
        _text("new")(tmp)
        p.write_text("theirs")  # another writer gets there first, before the rename

    atomic_write(p, w, later=later)
    with pytest.raises(OutputExistsError, match=r"v\.bin"):
        later[0].join()
    assert os.listdir(tmp_path) == ["v.bin"] and p.read_text() == "theirs"
