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
