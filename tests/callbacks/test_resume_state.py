"""Mid-epoch resume is bitwise: RNG (ResumeState), data position (resumable loader), accumulation."""
from __future__ import annotations

import lightning as L
import pytest
import torch
from _models import Classifier, classification_data, mlp

from mptrain import Trainer

STEPS, SAVE_AT = 10, 4  # 12 batches per epoch, accumulation 2: 6 steps an epoch; step 4 is mid-epoch


def _loader(generator_seed=None, n=96, batch_size=8):
    generator = None if generator_seed is None else torch.Generator().manual_seed(generator_seed)
    return torch.utils.data.DataLoader(classification_data(n=n), batch_size=batch_size, shuffle=True,
                                       generator=generator)


def _fit(root, max_steps, precision="32-true", ckpt_path=None, generator_seed=None, trainer_cls=Trainer, **kw):
    torch.manual_seed(0)
    model = Classifier(mlp(dropout=0.25), lr=1e-2)
    args = dict(accelerator="cpu", devices=1, max_steps=max_steps, default_root_dir=str(root), logger=False,
                enable_progress_bar=False, enable_model_summary=False, accumulate_grad_batches=2)
    if trainer_cls is Trainer:
        args.update(precision=precision, seed=0, checkpoint_every_n_steps=SAVE_AT)
    else:
        L.seed_everything(0)
        args["callbacks"] = [L.pytorch.callbacks.ModelCheckpoint(every_n_train_steps=SAVE_AT, save_last=True)]
    args.update(kw)
    trainer = trainer_cls(**args)
    trainer.fit(model, _loader(generator_seed), ckpt_path=ckpt_path)
    trainer.save_checkpoint(root / "end.ckpt")
    return torch.stack(model.losses), torch.load(root / "end.ckpt", weights_only=True)


def _assert_same_end(a: dict, b: dict) -> None:
    assert a["global_step"] == b["global_step"] == STEPS
    for name, t in a["state_dict"].items():
        assert t.dtype == torch.float32, f"{name} is {t.dtype}: checkpoints hold fp32 weights"
        assert torch.equal(t, b["state_dict"][name]), name
    for sa, sb in zip(a["optimizer_states"][0]["state"].values(), b["optimizer_states"][0]["state"].values()):
        for k in sa:
            assert torch.equal(torch.as_tensor(sa[k]), torch.as_tensor(sb[k])), k


@pytest.mark.parametrize("precision, generator_seed", [("32-true", None), ("bf16-master", None), ("32-true", 99)])
def test_mid_epoch_resume_is_bitwise(tmp_path, precision, generator_seed):
    losses, end = _fit(tmp_path / "straight", STEPS, precision, generator_seed=generator_seed)
    first, _ = _fit(tmp_path / "cut", SAVE_AT, precision, generator_seed=generator_seed)
    assert torch.equal(first, losses[: 2 * SAVE_AT])
    rest, resumed_end = _fit(tmp_path / "cut", STEPS, precision, ckpt_path="last", generator_seed=generator_seed)
    assert len(rest) == 2 * (STEPS - SAVE_AT)
    assert torch.equal(rest, losses[2 * SAVE_AT:])
    _assert_same_end(end, resumed_end)


def test_plain_lightning_does_not_resume_this_exactly(tmp_path):
    """The control: without mptrain's resume state the same resume replays other batches."""
    losses, _ = _fit(tmp_path / "straight", STEPS, trainer_cls=L.Trainer)
    _fit(tmp_path / "cut", SAVE_AT, trainer_cls=L.Trainer)
    with pytest.warns(UserWarning, match="not resumable"):
        rest, _ = _fit(tmp_path / "cut", STEPS, ckpt_path="last", trainer_cls=L.Trainer)
    assert not torch.equal(rest[:4], losses[2 * SAVE_AT: 2 * SAVE_AT + 4])


def test_same_batches_and_losses_as_lightning(tmp_path):
    """The resumable loader keeps torch's shuffle order: an uninterrupted run is Lightning's run."""
    ours, _ = _fit(tmp_path / "ours", 3)
    theirs, _ = _fit(tmp_path / "theirs", 3, trainer_cls=L.Trainer)
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("change, message", [
    (dict(accumulate_grad_batches=3), "accumulate_grad_batches 2 -> 3"),
    (dict(limit_train_batches=6), "num_training_batches 12 -> 6"),
])
def test_mid_epoch_resume_with_another_epoch_layout_is_refused(tmp_path, change, message):
    _fit(tmp_path, SAVE_AT)
    with pytest.raises(ValueError, match=f"cannot resume mid-epoch.*{message}"):
        _fit(tmp_path, STEPS, ckpt_path="last", **change)


@pytest.mark.parametrize("damage", [dict(rng=None), dict(layout={"world_size": 1})])
def test_a_damaged_resume_entry_is_a_checkpoint_error(tmp_path, damage):
    from mptrain import CheckpointError

    _fit(tmp_path, SAVE_AT)
    last = tmp_path / "checkpoints" / "last.ckpt"
    state = torch.load(last, weights_only=True)
    state["callbacks"]["ResumeState"].update(damage)
    torch.save(state, last)
    with pytest.raises(CheckpointError, match="last.ckpt.*ResumeState entry is damaged"):
        _fit(tmp_path, STEPS, ckpt_path="last")


def test_a_checkpoint_without_resume_state_warns(tmp_path):
    _fit(tmp_path, SAVE_AT, trainer_cls=L.Trainer)
    with pytest.warns(UserWarning, match="holds no ResumeState"):
        _fit(tmp_path, SAVE_AT + 1, ckpt_path=str(tmp_path / "checkpoints" / "last.ckpt"))


def test_a_different_world_size_mid_epoch_is_refused_naming_both():
    from mptrain.callbacks.resume_state import _check_layout

    saved = {"world_size": 1, "accumulate_grad_batches": 2, "num_training_batches": 24, "batch_in_epoch": 10}
    now = dict(saved, world_size=2, num_training_batches=12)
    with pytest.raises(ValueError, match=r"batch 10 of 24.*world_size 1 -> 2, num_training_batches 24 -> 12"):
        _check_layout(saved, now)
    _check_layout(dict(saved, batch_in_epoch=24), now)  # at an epoch's end any layout may follow


def test_order_not_restorable_names_samplers_without_state():
    from torchdata.stateful_dataloader import StatefulDataLoader

    from mptrain.callbacks.resumable_loader import order_not_restorable, to_resumable

    ds = classification_data(n=16)
    assert order_not_restorable(to_resumable(_loader())) == []
    assert order_not_restorable(to_resumable(torch.utils.data.DataLoader(ds, batch_size=4))) == []
    weighted = torch.utils.data.WeightedRandomSampler(torch.ones(16), 16)
    assert order_not_restorable(to_resumable(torch.utils.data.DataLoader(ds, sampler=weighted))) == [
        "WeightedRandomSampler"]
    assert order_not_restorable(StatefulDataLoader(ds, batch_size=4, shuffle=True)) == []


def test_resume_with_a_sampler_without_state_warns(tmp_path):
    def fit(max_steps, ckpt_path=None):
        torch.manual_seed(0)
        sampler = torch.utils.data.WeightedRandomSampler(torch.ones(96), 96)
        loader = torch.utils.data.DataLoader(classification_data(n=96), batch_size=8, sampler=sampler)
        trainer = Trainer(accelerator="cpu", max_steps=max_steps, default_root_dir=str(tmp_path), logger=False,
                          enable_progress_bar=False, checkpoint_every_n_steps=SAVE_AT)
        trainer.fit(Classifier(mlp()), loader, ckpt_path=ckpt_path)

    fit(SAVE_AT)
    with pytest.warns(UserWarning, match="resuming mid-epoch with WeightedRandomSampler: it keeps no state"):
        fit(SAVE_AT + 1, ckpt_path="last")


@pytest.mark.parametrize("make", [
    lambda ds: torch.utils.data.DataLoader(ds, batch_size=None),  # automatic batching off
    lambda ds: torch.utils.data.DataLoader(ds, batch_size=3, drop_last=True),
    lambda ds: torch.utils.data.DataLoader(ds, batch_sampler=[[4, 1], [0, 2, 3]]),  # the user's batch sampler
])
def test_to_resumable_yields_what_the_plain_loader_yields(make):
    from mptrain.callbacks.resumable_loader import ResumableDataLoader, to_resumable

    ds = torch.utils.data.TensorDataset(torch.arange(5))
    converted = to_resumable(make(ds))
    assert isinstance(converted, ResumableDataLoader)
    assert [b[0].tolist() for b in converted] == [b[0].tolist() for b in make(ds)]
