"""Checkpoint directory bookkeeping (rl360.checkpointing) with stand-in model groups: which directories a run
writes, keeps, prunes, moves aside or removes, and what a run killed at any moment leaves behind."""

import json

import pytest
import torch

from rl360.checkpointing import latest_checkpoint, load_checkpoint, load_extra, open_checkpoints, save_checkpoint


class FakeGroup:
    """Writes one file per checkpoint, as a PolicyGroup's ranks write their shards; can fail midway."""

    def __init__(self, value: str = "weights", fail: bool = False):
        self.value, self.fail, self.loaded = value, fail, None

    def call(self, method: str, ckpt_dir: str) -> list:
        from pathlib import Path

        if method == "save_checkpoint":
            Path(ckpt_dir).mkdir(parents=True)
            (Path(ckpt_dir) / "shard.bin").write_text(self.value)
            if self.fail:
                raise KeyboardInterrupt("killed while writing")  # stands for the process dying here
        elif method == "load_checkpoint":
            self.loaded = (Path(ckpt_dir) / "shard.bin").read_text()
        return [None]


def _save(root, step, keep=2, **groups):
    return save_checkpoint(root, step, groups or {"policy": FakeGroup(f"w{step}")}, {"data": {"at": step}}, keep)


def _names(root):
    return sorted(p.name for p in root.iterdir())


def _another_runs_checkpoints(root):
    for step in (9, 10):
        (root / f"step_{step:06d}" / "policy").mkdir(parents=True)
        (root / f"step_{step:06d}" / "trainer.json").write_text(json.dumps({"step": step}))
    (root / "latest").write_text("step_000010\n")


def test_saving_never_prunes_the_checkpoint_just_written_nor_newer_ones(tmp_path):
    """The reported failure: step 2 written beside another run's steps 9 and 10 was deleted as "oldest" and
    `latest` named a deleted directory. Pruning only ever removes checkpoints older than the new one."""
    _another_runs_checkpoints(tmp_path)
    _save(tmp_path, 2)
    assert latest_checkpoint(tmp_path) == tmp_path / "step_000002"
    assert _names(tmp_path) == ["latest", "step_000002", "step_000009", "step_000010"]


def test_pruning_keeps_the_newest_complete_checkpoints(tmp_path):
    for step in (1, 2, 3, 4):
        _save(tmp_path, step, keep=2)
    assert _names(tmp_path) == ["latest", "step_000003", "step_000004"]
    _save(tmp_path, 5, keep=1)
    assert _names(tmp_path) == ["latest", "step_000005"]
    _save(tmp_path, 6, keep=0)  # 0: keep every checkpoint
    assert _names(tmp_path) == ["latest", "step_000005", "step_000006"]


def test_a_checkpoint_is_written_under_a_partial_name_and_renamed_when_complete(tmp_path):
    _save(tmp_path, 1)
    with pytest.raises(KeyboardInterrupt):
        _save(tmp_path, 2, policy=FakeGroup(), critic=FakeGroup(fail=True))
    assert _names(tmp_path) == ["latest", "step_000001", "step_000002.partial"]
    assert not (tmp_path / "step_000002.partial" / "trainer.json").exists()
    assert latest_checkpoint(tmp_path) == tmp_path / "step_000001"


def test_extra_files_are_part_of_the_checkpoint_they_are_written_with(tmp_path):
    """`extra` objects (async mode's steps drawn ahead) are pickled inside the checkpoint, so they move, prune and
    come back with it; a checkpoint written without them has none."""
    kept = {"steps": {3: torch.arange(4)}, "data_after": {"at": 3}}
    save_checkpoint(tmp_path, 2, {"policy": FakeGroup()}, {"data": {"at": 2}}, 0, extra={"ahead.pt": kept})
    _save(tmp_path, 4)
    assert sorted(p.name for p in (tmp_path / "step_000002").iterdir()) == ["ahead.pt", "policy", "trainer.json"]
    loaded = load_extra(tmp_path / "step_000002", "ahead.pt")
    assert loaded["data_after"] == {"at": 3} and torch.equal(loaded["steps"][3], torch.arange(4))
    assert load_extra(tmp_path / "step_000004", "ahead.pt") is None


def test_resuming_removes_what_the_interrupted_run_wrote_after_latest(tmp_path, capsys):
    _save(tmp_path, 1)
    _save(tmp_path, 2)
    (tmp_path / "step_000003.partial" / "policy").mkdir(parents=True)  # killed while writing step 3
    (tmp_path / "step_000004").mkdir()  # renamed, killed before `latest` moved (or written by hand)
    resumed = open_checkpoints(tmp_path, resume=True)
    assert resumed == tmp_path / "step_000002"
    assert _names(tmp_path) == ["latest", "step_000001", "step_000002"]
    assert "step_000003.partial" in capsys.readouterr().out
    group = FakeGroup()
    assert load_checkpoint(resumed, {"policy": group}) == {"step": 2, "data": {"at": 2}}
    assert group.loaded == "w2"


@pytest.mark.parametrize("resume", [False, True])
def test_a_fresh_run_moves_another_runs_checkpoints_aside(tmp_path, capsys, resume):
    """resume=false (or resume=true without a complete checkpoint): the directory is moved aside whole, with a
    message naming both places; nothing in it is changed."""
    root = tmp_path / "checkpoints"
    root.mkdir()
    if resume:
        (root / "step_000003.partial").mkdir()  # a run killed before its first checkpoint completed
    else:
        _another_runs_checkpoints(root)
    before = {p.relative_to(root): p.read_bytes() if p.is_file() else None for p in root.rglob("*")}
    assert open_checkpoints(root, resume=resume) is None
    assert not root.exists()
    (moved,) = tmp_path.glob("checkpoints.old-*")
    assert {p.relative_to(moved): p.read_bytes() if p.is_file() else None for p in moved.rglob("*")} == before
    assert f"moved {root} aside to {moved}" in capsys.readouterr().out
    _save(root, 2)
    assert _names(root) == ["latest", "step_000002"]
    open_checkpoints(root, resume=False)  # a second fresh start (within the same second) gets a name of its own
    assert len(list(tmp_path.glob("checkpoints.old-*"))) == 2


def test_an_empty_or_missing_directory_is_used_as_it_is(tmp_path):
    assert open_checkpoints(tmp_path / "absent", resume=False) is None
    (tmp_path / "empty").mkdir()
    assert open_checkpoints(tmp_path / "empty", resume=True) is None
    assert (tmp_path / "empty").is_dir() and not list(tmp_path.glob("*.old-*"))


def test_a_pointer_to_a_missing_checkpoint_is_an_error_naming_it(tmp_path):
    _save(tmp_path, 1)
    (tmp_path / "latest").write_text("step_000007\n")
    with pytest.raises(FileNotFoundError, match="step_000007"):
        open_checkpoints(tmp_path, resume=True)


def test_a_checkpoint_of_the_same_step_is_never_overwritten(tmp_path):
    _save(tmp_path, 3)
    with pytest.raises(FileExistsError, match="step_000003"):
        _save(tmp_path, 3)
    assert latest_checkpoint(tmp_path) == tmp_path / "step_000003"


def test_convert_finds_the_policy_in_a_trainer_checkpoint_however_it_is_named(tmp_path):
    """`rl360 convert megatron-to-hf --ckpt` takes the checkpoints directory (its `latest`), a step directory
    or the policy directory; anything else stops with a message naming the missing rl360.json."""
    from rl360.convert import resolve_checkpoint
    from rl360.errors import UserError

    _save(tmp_path, 4)
    (tmp_path / "step_000004" / "policy" / "rl360.json").write_text("{}")
    policy = tmp_path / "step_000004" / "policy"
    for given in (tmp_path, tmp_path / "step_000004", policy):
        assert resolve_checkpoint(given) == policy
    with pytest.raises(UserError, match="critic/rl360.json not found"):
        resolve_checkpoint(tmp_path / "step_000004" / "critic")
