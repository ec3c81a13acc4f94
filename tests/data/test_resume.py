"""Resume from a LightningDataModule: loader workers, per-sample augmentation and epoch boundaries."""
from __future__ import annotations

import lightning as L
import pytest
import torch
from _models import Classifier, classification_data, mlp

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


@pytest.mark.parametrize("num_workers, save_at", [(0, 5), (2, 5), (0, 12)])  # 12 batches an epoch: 12 is its end
def test_resume_from_a_datamodule_is_bitwise(tmp_path, num_workers, save_at):
    losses, weights = _fit(tmp_path / "straight", 20, num_workers)
    _fit(tmp_path / "cut", save_at, num_workers, every=save_at)
    rest, resumed = _fit(tmp_path / "cut", 20, num_workers, ckpt_path="last", every=save_at)
    assert torch.equal(rest, losses[save_at:])
    for name, t in weights.items():
        assert torch.equal(t, resumed[name]), name
