"""Resume from a LightningDataModule: loader workers, per-sample augmentation and epoch boundaries."""
from __future__ import annotations

import lightning as L
import pytest
import torch
from _models import Classifier, classification_data, mlp
from lightning.pytorch.callbacks import ModelCheckpoint

from mptrain import Trainer


class NoisyData(torch.utils.data.Dataset):
    """Augments every sample with noise from torch's global RNG (a worker's, when workers load)."""

    def __init__(self, n=96):
        self.base = classification_data(n=n)

    def __len__(self):
        return len(self.base)

    def __getitem__(self, i):
        x, y = self.base[i]
        return x + 0.1 * torch.randn_like(x), y


class NoisyDataModule(L.LightningDataModule):
    def __init__(self, num_workers: int):
        super().__init__()
        self.num_workers = num_workers

    def train_dataloader(self):
        return torch.utils.data.DataLoader(NoisyData(), batch_size=8, shuffle=True, num_workers=self.num_workers,
                                           persistent_workers=self.num_workers > 0)


def _fit(root, max_steps, num_workers, ckpt_path=None, every=4):
    torch.manual_seed(0)
    model = Classifier(mlp(dropout=0.2))
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=max_steps, default_root_dir=str(root), logger=False,
                      enable_progress_bar=False, enable_model_summary=False, seed=0, checkpoint_every_n_steps=every)
    trainer.fit(model, datamodule=NoisyDataModule(num_workers), ckpt_path=ckpt_path)
    return torch.stack(model.losses), model.state_dict()


@pytest.mark.parametrize("num_workers, save_at", [(0, 5), (2, 5), (0, 12), (2, 12)])  # 12 batches an epoch: 12 is its end
def test_resume_from_a_datamodule_is_bitwise(tmp_path, num_workers, save_at):
    losses, weights = _fit(tmp_path / "straight", 20, num_workers)
    _fit(tmp_path / "cut", save_at, num_workers, every=save_at)
    rest, resumed = _fit(tmp_path / "cut", 20, num_workers, ckpt_path="last", every=save_at)
    assert torch.equal(rest, losses[save_at:])
    for name, t in weights.items():
        assert torch.equal(t, resumed[name]), name


class ShuffledStream(torch.utils.data.IterableDataset):
    """No length: Lightning finds each epoch's last batch by reading one ahead; the order comes from the global RNG."""

    def __init__(self, n=64):
        self.base = classification_data(n=n)

    def __iter__(self):
        for i in torch.randperm(len(self.base)).tolist():
            yield self.base[i]


@pytest.mark.parametrize("position", ["step=8", "epoch=0"])  # the last batch of epoch 0, and its end
def test_resume_at_an_epoch_boundary_of_an_iterable_dataset_is_bitwise(tmp_path, position):
    def fit(root, ckpt_path=None, callbacks=()):
        torch.manual_seed(0)
        model = Classifier(mlp(dropout=0.2))
        trainer = Trainer(accelerator="cpu", max_epochs=3, default_root_dir=str(root), logger=False, seed=0,
                          enable_progress_bar=False, enable_model_summary=False, callbacks=list(callbacks),
                          enable_checkpointing=bool(callbacks))
        trainer.fit(model, torch.utils.data.DataLoader(ShuffledStream(), batch_size=8), ckpt_path=ckpt_path)
        return trainer.global_step, torch.stack(model.losses)

    folder = tmp_path / "ckpt"
    steps, losses = fit(tmp_path, callbacks=[
        ModelCheckpoint(dirpath=folder, filename="{step}", every_n_train_steps=8, save_top_k=-1),
        ModelCheckpoint(dirpath=folder, filename="{epoch}", save_top_k=-1)])
    resumed_steps, rest = fit(tmp_path / "resumed", str(folder / f"{position}.ckpt"))
    assert (steps, resumed_steps) == (24, 24) and torch.equal(rest, losses[8:])


def test_saving_after_fit_draws_nothing_and_keeps_the_position(tmp_path):
    """torchdata reads a loader's state from a new iterator once Lightning let go of its own: not from ours."""
    from mptrain.resume.rng import rng_state

    torch.manual_seed(0)
    trainer = Trainer(accelerator="cpu", max_steps=5, default_root_dir=str(tmp_path), logger=False, seed=0,
                      enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
    trainer.fit(Classifier(mlp()), datamodule=NoisyDataModule(num_workers=0))
    before = rng_state()["torch"]
    trainer.save_checkpoint(tmp_path / "after_fit.ckpt")
    assert torch.equal(rng_state()["torch"], before), "saving drew from the global RNG"
    (loader,) = torch.load(tmp_path / "after_fit.ckpt", weights_only=True)["loops"]["fit_loop"]["state_dict"][
        "combined_loader"]
    assert loader["_num_yielded"] == 5, "the checkpoint lost the position fit ended at"
