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


def test_pruning_checkpoints_never_leaves_a_half_deleted_one(tmp_path, monkeypatch):
    """A kill while a checkpoint is deleted leaves it whole or hidden, never a `step-N` that `--resume`
    would read as complete; the next prune clears the hidden leftover."""
    import shutil

    from glance_rt.tools.training.loop import prune_checkpoints

    ckpts = tmp_path / "checkpoints"
    for step in (1, 2, 3, 4):
        (ckpts / f"step-{step:06d}").mkdir(parents=True)
        (ckpts / f"step-{step:06d}" / "drafter.safetensors").write_bytes(b"w")
    rmtree = shutil.rmtree

    def killed(path, *a, **kw):  # the process dies mid-delete
        raise KeyboardInterrupt

    monkeypatch.setattr(shutil, "rmtree", killed)
    with pytest.raises(KeyboardInterrupt):
        prune_checkpoints(tmp_path, best=1, keep=2)
    monkeypatch.setattr(shutil, "rmtree", rmtree)
    visible = sorted(p.name for p in ckpts.glob("step-*"))
    assert visible == ["step-000001", "step-000003", "step-000004"]  # step 2 is gone from view, not half there
    assert all((ckpts / n / "drafter.safetensors").exists() for n in visible)
    prune_checkpoints(tmp_path, best=1, keep=2)
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-000001", "step-000003", "step-000004"]
