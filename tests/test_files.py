"""glance_rt.files: removing and building shared entries so that a kill or a second process never leaves
or reads a half-written one."""
import pytest

from glance_rt.files import atomic_remove, exclusive


def test_atomic_remove_renames_then_deletes_and_clears_a_killed_calls_leftover(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "w.bin").write_bytes(b"x")
    (tmp_path / ".d.old").mkdir()  # what a kill between the rename and the delete leaves
    (tmp_path / "f.json").write_text("{}")
    atomic_remove(tmp_path / "d")
    atomic_remove(tmp_path / "f.json")
    atomic_remove(tmp_path / "absent")
    assert list(tmp_path.iterdir()) == []


def test_exclusive_holds_the_entrys_lock_until_the_block_ends(tmp_path):
    """Two processes converting the same GGUF file: one holds the entry's lock while it converts, the other
    waits for it (flock locks an open file, so a second open here stands in for the second process)."""
    fcntl = pytest.importorskip("fcntl")
    entry = tmp_path / "cache" / "model-1234"
    with exclusive(entry):
        with open(entry.with_name(".model-1234.lock")) as other:
            with pytest.raises(BlockingIOError):
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
    with open(entry.with_name(".model-1234.lock")) as other:
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # free once the block has ended
