"""AtomicCheckpointIO: atomic saves (SIGKILL mid-save), safe loads, clear errors for damaged files."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import torch

from mptrain import AtomicCheckpointIO, CheckpointError

SCRIPTS = Path(__file__).parent / "scripts"


def _state(value: float = 1.0) -> dict:
    return {"state_dict": {"w": torch.full((4, 4), value), "b": torch.zeros(4)}, "epoch": 0, "global_step": 3}


def test_round_trip_and_no_temp_files_left(tmp_path):
    io = AtomicCheckpointIO()
    path = tmp_path / "sub" / "a.ckpt"
    io.save_checkpoint(_state(2.0), path)
    loaded = io.load_checkpoint(path)
    assert torch.equal(loaded["state_dict"]["w"], torch.full((4, 4), 2.0)) and loaded["global_step"] == 3
    assert sorted(p.name for p in path.parent.iterdir()) == ["a.ckpt"]


class _Payload:
    def __init__(self, flag: Path):
        self.flag = flag

    def __reduce__(self):
        return (Path.touch, (self.flag,))


def test_pickle_payload_is_refused_and_never_runs(tmp_path):
    path, flag = tmp_path / "evil.ckpt", tmp_path / "FLAG"
    torch.save({"state_dict": {}, "x": _Payload(flag)}, path)
    with pytest.raises(CheckpointError, match="evil.ckpt.*could run code"):
        AtomicCheckpointIO().load_checkpoint(path)
    assert not flag.exists()
    torch.load(path, weights_only=False)  # the payload is real: an unsafe load runs it
    assert flag.exists()


def test_weights_only_false_is_refused(tmp_path):
    AtomicCheckpointIO().save_checkpoint(_state(), tmp_path / "a.ckpt")
    with pytest.raises(CheckpointError, match="weights_only=False"):
        AtomicCheckpointIO().load_checkpoint(tmp_path / "a.ckpt", weights_only=False)


def _flip_first_byte_of(path: Path, record_suffix: str) -> None:
    with zipfile.ZipFile(path) as zf:
        info = next(i for i in zf.infolist() if i.filename.endswith(record_suffix))
    with open(path, "r+b") as f:
        f.seek(info.header_offset + 26)
        name_len, extra_len = int.from_bytes(f.read(2), "little"), int.from_bytes(f.read(2), "little")
        offset = info.header_offset + 30 + name_len + extra_len
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x40]))


@pytest.mark.parametrize(
    "damage, message",
    [
        ("text", "not a torch.save zip archive"),
        ("truncated", "not a torch.save zip archive|damaged"),
        ("flipped_bit", "fails its CRC32 check"),
        ("missing", "does not exist"),
    ],
)
def test_damaged_files_raise_checkpoint_error_naming_the_file(tmp_path, damage, message):
    path = tmp_path / "bad.ckpt"
    if damage == "text":
        path.write_text("epoch: 3\n")
    elif damage != "missing":
        AtomicCheckpointIO().save_checkpoint(_state(), path)
        if damage == "truncated":
            data = path.read_bytes()
            path.write_bytes(data[: len(data) // 2])
        else:
            _flip_first_byte_of(path, "data/0")
            assert torch.load(path, weights_only=True)["state_dict"]  # torch alone loads it silently
    with pytest.raises(CheckpointError, match=message) as e:
        AtomicCheckpointIO().load_checkpoint(path)
    assert "bad.ckpt" in str(e.value)


def test_what_lightning_hands_over_is_written_as_is(tmp_path):
    """Non-finite weights (the precision plugin warns about them) and bare weights (what ddp_spawn passes back
    through the CheckpointIO) are written and read back as TorchCheckpointIO would."""
    io = AtomicCheckpointIO()
    io.save_checkpoint(_state(float("nan")), tmp_path / "nan.ckpt")
    assert torch.isnan(io.load_checkpoint(tmp_path / "nan.ckpt")["state_dict"]["w"]).all()
    io.save_checkpoint({"w": torch.ones(2)}, tmp_path / ".temp.ckpt")
    assert torch.equal(io.load_checkpoint(tmp_path / ".temp.ckpt")["w"], torch.ones(2))


def test_a_missing_file_is_a_file_not_found_error_as_in_lightning(tmp_path):
    with pytest.raises(FileNotFoundError, match="Checkpoint file not found: .*nowhere.ckpt"):
        AtomicCheckpointIO().load_checkpoint(tmp_path / "nowhere.ckpt")


@pytest.mark.slow
def test_sigkill_mid_save_keeps_previous_checkpoint_and_next_save_removes_orphan(tmp_path):
    path = tmp_path / "big.ckpt"
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parents[1]), OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, str(SCRIPTS / "save_loop.py"), str(path)], stdout=subprocess.PIPE,
                            text=True, env=env)
    try:
        assert proc.stdout.readline().startswith("saved 0")
        deadline = time.monotonic() + 120
        while not list(tmp_path.glob(".big.ckpt.*")):  # wait until a new save is under way
            assert time.monotonic() < deadline and proc.poll() is None, "the saving process stopped"
            time.sleep(0.001)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    orphans = list(tmp_path.glob(".big.ckpt.*"))
    assert orphans, "the kill did not land mid-save"
    state = AtomicCheckpointIO().load_checkpoint(path)
    i = state["i"]
    assert torch.equal(state["state_dict"]["w"], torch.full((16, 1024, 1024), float(i)))
    AtomicCheckpointIO().save_checkpoint(_state(), tmp_path / "other.ckpt")
    assert not list(tmp_path.glob(".*.ckpt.*")), "the next save left the orphan temp file"


@pytest.mark.parametrize("precision", ["bf16-master", "bf16-mixed", "32-true"])
def test_a_nan_step_leaves_every_checkpoint_finite_and_last_loadable(tmp_path, precision):
    """Without a loss scaler a NaN step used to poison every later checkpoint."""
    sys.path.insert(0, str(Path(__file__).parent))
    from _models import Classifier, classification_data, mlp, quiet_trainer

    model = Classifier(mlp(), inf_at_steps={2})
    loader = torch.utils.data.DataLoader(classification_data(n=64), batch_size=8)
    trainer = quiet_trainer(precision=precision, max_steps=6, enable_checkpointing=True, checkpoint_every_n_steps=1,
                            default_root_dir=str(tmp_path))
    trainer.fit(model, loader)
    assert trainer.skipped_steps == 1
    saved = sorted((tmp_path / "checkpoints").glob("*.ckpt"))
    assert any(p.name == "last.ckpt" for p in saved) and len(saved) >= 2
    io = AtomicCheckpointIO()
    for path in saved:
        state = io.load_checkpoint(path)["state_dict"]
        assert all(torch.isfinite(t).all() for t in state.values() if t.is_floating_point()), path.name
    Classifier.load_from_checkpoint(tmp_path / "checkpoints" / "last.ckpt", net=mlp())


@pytest.mark.parametrize("damage", ["garbage", "truncated", "flipped_bit"])
def test_a_damaged_file_is_named_and_called_damaged_never_advising_weights_only_false(tmp_path, damage):
    path = tmp_path / "bad.ckpt"
    AtomicCheckpointIO().save_checkpoint(_state(), path)
    if damage == "garbage":
        path.write_bytes(os.urandom(4096))
    elif damage == "truncated":
        path.write_bytes(path.read_bytes()[:100])
    else:
        _flip_first_byte_of(path, "data/0")
    with pytest.raises(CheckpointError, match="bad.ckpt.*is damaged") as e:
        AtomicCheckpointIO().load_checkpoint(path)
    assert "weights_only=False" not in str(e.value)
