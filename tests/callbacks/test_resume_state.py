"""Resume is bitwise: RNG (ResumeState), data position (resumable loader), accumulation, mid-epoch and at
epoch boundaries (the last batch, the epoch's end, after fit)."""
from __future__ import annotations

import lightning as L
import pytest
import torch
from _models import Classifier, classification_data, mlp
from lightning.pytorch.callbacks import ModelCheckpoint

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
    from mptrain.resume.state import check_layout as _check_layout

    saved = {"world_size": 1, "accumulate_grad_batches": 2, "num_training_batches": 24, "batch_in_epoch": 10}
    now = dict(saved, world_size=2, num_training_batches=12)
    with pytest.raises(ValueError, match=r"batch 10 of 24.*world_size 1 -> 2, num_training_batches 24 -> 12"):
        _check_layout(saved, now)
    _check_layout(dict(saved, batch_in_epoch=24), now)  # at an epoch's end any layout may follow


def test_order_not_restorable_names_samplers_without_state():
    from torchdata.stateful_dataloader import StatefulDataLoader

    from mptrain.resume.loader import order_not_restorable, to_resumable

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
    from mptrain.resume.loader import ResumableDataLoader, to_resumable

    ds = torch.utils.data.TensorDataset(torch.arange(5))
    converted = to_resumable(make(ds))
    assert isinstance(converted, ResumableDataLoader)
    assert [b[0].tolist() for b in converted] == [b[0].tolist() for b in make(ds)]


# -- epoch boundaries: a 2-layer MLP with dropout 0.2, AdamW, 256 samples in batches of 32 (8 an epoch), shuffled --

def _epochs_fit(root, max_epochs, ckpt_path=None, callbacks=(), shuffle=True, dropout=0.2, **kw):
    torch.manual_seed(0)
    model = Classifier(mlp(dropout=dropout), lr=1e-2)
    loader = torch.utils.data.DataLoader(classification_data(n=256), batch_size=32, shuffle=shuffle)
    args = dict(accelerator="cpu", devices=1, max_epochs=max_epochs, default_root_dir=str(root), logger=False,
                enable_progress_bar=False, enable_model_summary=False, seed=0, callbacks=list(callbacks))
    trainer = Trainer(**{**args, **kw})
    trainer.fit(model, loader, ckpt_path=ckpt_path)
    losses = torch.stack(model.losses) if model.losses else torch.empty(0)
    return trainer, losses, {k: v.clone() for k, v in model.state_dict().items()}


def _every(root, steps):
    return ModelCheckpoint(dirpath=root / "ckpt", filename="{step}", every_n_train_steps=steps, save_top_k=-1,
                           save_last=True)


def _assert_continues(straight, resumed, trained):
    """``resumed`` went on from batch ``trained`` of ``straight`` exactly: step count, losses, weights."""
    (t1, losses, weights), (t2, rest, resumed_weights) = straight, resumed
    assert t2.global_step == t1.global_step, f"ended at global_step {t2.global_step}, not {t1.global_step}"
    assert len(rest) == len(losses) - trained, f"trained {len(rest)} batches, not {len(losses) - trained}"
    assert torch.equal(rest, losses[trained:]), "other losses than the uninterrupted run"
    for name, t in weights.items():
        assert torch.equal(t, resumed_weights[name]), name


def test_resume_from_last_batch_of_epoch(tmp_path):
    """Saved on the epoch's last batch (ModelCheckpoint(every_n_train_steps=8, save_last=True), 8 steps an epoch):
    the resumed run trains every epoch still due."""
    straight = _epochs_fit(tmp_path, 3, callbacks=[_every(tmp_path, 8)])
    resumed = _epochs_fit(tmp_path / "resumed", 3, ckpt_path=str(tmp_path / "ckpt" / "step=8.ckpt"))
    _assert_continues(straight, resumed, trained=8)


@pytest.mark.parametrize("accumulate, step, trained", [(2, 4, 8), (3, 3, 8), (3, 6, 16)])
def test_resume_from_last_batch_of_epoch_with_accumulation(tmp_path, accumulate, step, trained):
    """With 3, the window does not divide the 8-batch epoch: its last step closes a window of 2."""
    straight = _epochs_fit(tmp_path, 3, callbacks=[_every(tmp_path, 1)], accumulate_grad_batches=accumulate)
    resumed = _epochs_fit(tmp_path / "resumed", 3, ckpt_path=str(tmp_path / "ckpt" / f"step={step}.ckpt"),
                          accumulate_grad_batches=accumulate)
    _assert_continues(straight, resumed, trained)


@pytest.mark.parametrize("step", [5, 10])
def test_resume_from_last_batch_of_epoch_limit_train_batches(tmp_path, step):
    """limit_train_batches=5 of 8 shuffled batches: the next epoch is a new shuffle, not batches 6-8 of the last."""
    straight = _epochs_fit(tmp_path, 3, callbacks=[_every(tmp_path, 5)], limit_train_batches=5)
    resumed = _epochs_fit(tmp_path / "resumed", 3, ckpt_path=str(tmp_path / "ckpt" / f"step={step}.ckpt"),
                          limit_train_batches=5)
    _assert_continues(straight, resumed, trained=step)


@pytest.mark.parametrize("shuffle, dropout", [(False, 0.2), (True, 0.0)])
def test_resume_from_lightning_default_epoch_checkpoint(tmp_path, shuffle, dropout):
    """The checkpoint most users have: Lightning's default one, written at the end of each epoch."""
    straight = _epochs_fit(tmp_path / "straight", 3, shuffle=shuffle, dropout=dropout)
    _epochs_fit(tmp_path, 2, shuffle=shuffle, dropout=dropout)
    (ckpt,) = (tmp_path / "checkpoints").glob("*.ckpt")
    assert ckpt.name == "epoch=1-step=16.ckpt"
    resumed = _epochs_fit(tmp_path / "resumed", 3, ckpt_path=str(ckpt), shuffle=shuffle, dropout=dropout)
    _assert_continues(straight, resumed, trained=16)


@pytest.mark.parametrize("written", ["last.ckpt", "after fit"])
def test_resume_finished_fit_larger_max_epochs(tmp_path, written):
    """A finished 2-epoch fit continued to 3 epochs trains the third as the 3-epoch run did."""
    straight = _epochs_fit(tmp_path / "straight", 3)
    first, _, _ = _epochs_fit(tmp_path, 2, callbacks=[_every(tmp_path, 8)])
    if written == "after fit":
        first.save_checkpoint(tmp_path / "ckpt" / "after_fit.ckpt")
    ckpt = tmp_path / "ckpt" / ("last.ckpt" if written == "last.ckpt" else "after_fit.ckpt")
    resumed = _epochs_fit(tmp_path / "resumed", 3, ckpt_path=str(ckpt))
    _assert_continues(straight, resumed, trained=16)


def test_resume_after_fit_stopped_mid_epoch_by_max_steps(tmp_path):
    """A fit that max_steps stopped inside an epoch, saved after it returned, continues that epoch."""
    straight = _epochs_fit(tmp_path / "straight", 2)
    first, _, _ = _epochs_fit(tmp_path, 2, max_steps=5)
    first.save_checkpoint(tmp_path / "after_fit.ckpt")
    resumed = _epochs_fit(tmp_path / "resumed", 2, ckpt_path=str(tmp_path / "after_fit.ckpt"))
    _assert_continues(straight, resumed, trained=5)


def test_validation_inside_fit_does_not_move_the_training_rng(tmp_path):
    """A checkpoint written just before a mid-epoch validation: the resumed run skips that validation, and still
    repeats the uninterrupted run (validation draws from a copy of the RNG)."""
    val = torch.utils.data.DataLoader(classification_data(n=64, seed=1), batch_size=32, shuffle=True)

    def fit(root, ckpt_path=None, callbacks=()):
        torch.manual_seed(0)
        model = Classifier(mlp(dropout=0.2), lr=1e-2)
        trainer = Trainer(accelerator="cpu", max_epochs=1, default_root_dir=str(root), logger=False, seed=0,
                          enable_progress_bar=False, enable_model_summary=False, val_check_interval=3,
                          limit_val_batches=2, callbacks=list(callbacks))
        trainer.fit(model, torch.utils.data.DataLoader(classification_data(n=256), batch_size=32, shuffle=True), val,
                    ckpt_path=ckpt_path)
        return trainer, torch.stack(model.losses), {k: v.clone() for k, v in model.state_dict().items()}

    straight = fit(tmp_path, callbacks=[_every(tmp_path, 3)])
    _assert_continues(straight, fit(tmp_path / "resumed", str(tmp_path / "ckpt" / "step=3.ckpt")), trained=3)


@pytest.mark.parametrize("change", [dict(shuffle=False), dict(batch_size=16)])
def test_a_train_loader_changed_at_an_epoch_boundary_starts_the_next_epoch_afresh(tmp_path, change):
    """Any layout may follow an epoch's end: another sampler (its saved state does not fit: a warning says the order
    may differ) or another batch size (another epoch layout: nothing to rebuild)."""
    def fit(root, max_epochs, ckpt_path=None, shuffle=True, batch_size=32):
        torch.manual_seed(0)
        loader = torch.utils.data.DataLoader(classification_data(n=256), batch_size=batch_size, shuffle=shuffle)
        trainer = Trainer(accelerator="cpu", max_epochs=max_epochs, default_root_dir=str(root), logger=False, seed=0,
                          enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(Classifier(mlp(dropout=0.2)), loader, ckpt_path=ckpt_path)
        return trainer

    fit(tmp_path, 1)
    (ckpt,) = (tmp_path / "checkpoints").glob("*.ckpt")
    if "shuffle" in change:
        with pytest.warns(UserWarning, match="train loader state in checkpoint .* does not fit this run's "
                                             "ResumableDataLoader.*order may differ"):
            trainer = fit(tmp_path / "resumed", 2, str(ckpt), **change)
    else:
        trainer = fit(tmp_path / "resumed", 2, str(ckpt), **change)
    assert trainer.global_step == 8 + 256 // change.get("batch_size", 32)


def test_a_mid_epoch_resume_with_sharded_sampler_is_exact_and_does_not_warn(tmp_path):
    """ShardedSampler (a DistributedSampler) orders each epoch from (seed, epoch): the fast-forward is exact."""
    import warnings

    from mptrain.data import ShardedSampler

    def fit(max_steps, root, ckpt_path=None):
        torch.manual_seed(0)
        data = classification_data(n=96)
        loader = torch.utils.data.DataLoader(data, batch_size=8, sampler=ShardedSampler(len(data), seed=3))
        model = Classifier(mlp(dropout=0.2))
        trainer = Trainer(accelerator="cpu", max_steps=max_steps, default_root_dir=str(root), logger=False,
                          enable_progress_bar=False, checkpoint_every_n_steps=SAVE_AT)
        trainer.fit(model, loader, ckpt_path=ckpt_path)
        return torch.stack(model.losses)

    straight = fit(SAVE_AT + 4, tmp_path / "straight")
    fit(SAVE_AT, tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rest = fit(SAVE_AT + 4, tmp_path, ckpt_path="last")
    assert not [w for w in caught if "keeps no state" in str(w.message)]
    assert torch.equal(rest, straight[SAVE_AT:])
