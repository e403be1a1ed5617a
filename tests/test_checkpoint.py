"""Checkpoints: atomic, checksummed, damaged ones refused with a clear message, older ones kept."""

import pytest
import torch

from fastes.checkpoint import CheckpointError, latest_checkpoint, load_checkpoint, save_checkpoint


def test_round_trip_and_only_the_newest_are_kept(tmp_path):
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, {"w": torch.full((3,), float(step))}, {"step": step}, keep=2)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-00000002", "step-00000003"]
    step, tensors, state = latest_checkpoint(tmp_path)
    assert step == 3 and state == {"step": 3} and torch.equal(tensors["w"], torch.full((3,), 3.0))


def test_no_checkpoint_gives_none(tmp_path):
    assert latest_checkpoint(tmp_path) is None


@pytest.mark.parametrize("damage", ["truncate", "flip", "state"])
def test_damaged_checkpoints_are_refused(tmp_path, damage):
    save_checkpoint(tmp_path, 1, {"w": torch.zeros(100)}, {})
    path = save_checkpoint(tmp_path, 2, {"w": torch.ones(100)}, {})
    tensors = path / "tensors.safetensors"
    data = bytearray(tensors.read_bytes())
    if damage == "truncate":
        tensors.write_bytes(data[: len(data) // 2])
    elif damage == "flip":
        data[-1] ^= 0xFF
        tensors.write_bytes(bytes(data))
    else:
        (path / "state.json").write_text('{"step": 2, "sha')
    with pytest.raises(CheckpointError, match="step-00000002"):
        latest_checkpoint(tmp_path)
    # The previous good checkpoint is still there and loads.
    step, loaded, _ = load_checkpoint(tmp_path / "checkpoints" / "step-00000001")
    assert step == 1 and torch.equal(loaded["w"], torch.zeros(100))


def test_a_leftover_temporary_directory_is_ignored(tmp_path):
    save_checkpoint(tmp_path, 1, {"w": torch.zeros(2)}, {})
    (tmp_path / "checkpoints" / ".tmp-step-00000002").mkdir()  # a crash mid-write
    assert latest_checkpoint(tmp_path)[0] == 1
