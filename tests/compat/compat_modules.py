"""The LightningModule the compatibility suite trains under both trainers: a tiny MLP regressor
on random tensors that records every hook call, logs through every ``self.log`` flavour
(on_step / on_epoch / prog_bar, torchmetrics Metric objects) and returns its scheduler in
whatever Lightning config shape a case asks for."""
from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F
import torchmetrics
from lightning.pytorch.core.hooks import CheckpointHooks, DataHooks, ModelHooks
from torch.utils.data import DataLoader, TensorDataset

#: every hook of Lightning's hook classes, plus the LightningModule methods the loop calls
#: (configure_sharded_model is deprecated and would only add a warning)
HOOKS = sorted(
    ({n for c in (ModelHooks, DataHooks, CheckpointHooks) for n in vars(c) if not n.startswith("_")}
     - {"configure_sharded_model"})
    | {"configure_optimizers", "configure_callbacks", "training_step", "validation_step", "test_step",
       "predict_step", "backward", "optimizer_step", "optimizer_zero_grad", "lr_scheduler_step",
       "configure_gradient_clipping", "clip_gradients", "forward"})

FEATURES, SAMPLES = 8, 64


def _dataset(n: int, seed: int) -> TensorDataset:
    """A learnable regression: y = x @ w + small noise, fixed by ``seed``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, FEATURES, generator=g)
    w = torch.randn(FEATURES, 1, generator=g)
    return TensorDataset(x, x @ w + 0.01 * torch.randn(n, 1, generator=g))


def _recording(calls: list[str], name: str, fn):
    """``fn`` that first appends ``name`` to ``calls`` (the hook order both trainers must share)."""
    def hook(*args, **kwargs):
        calls.append(name)
        return fn(*args, **kwargs)
    return hook


def scheduler_config(kind: str, optimizer: torch.optim.Optimizer):
    """The scheduler part of ``configure_optimizers``' return value, one shape per ``kind``."""
    if kind == "steplr_epoch":
        return {"scheduler": torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7), "interval": "epoch"}
    if kind == "steplr_step":
        return {"scheduler": torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.7), "interval": "step",
                "frequency": 1, "name": "steplr"}
    if kind == "steplr_monitor":  # a `monitor` key on a non-plateau scheduler: Lightning ignores it
        return {"scheduler": torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5), "monitor": "val_loss"}
    if kind == "plateau":
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=0, threshold=0.5)
        return {"scheduler": plateau, "monitor": "val_loss", "interval": "epoch"}
    raise ValueError(f"unknown scheduler kind {kind!r}")


class CompatModule(L.LightningModule):
    """Records ``calls`` (hook names, in order), ``seen`` ((current_epoch, global_step) at every
    training_step), ``losses`` (detached training losses) and ``dtypes``."""

    def __init__(self, scheduler: str = "steplr_epoch", lr: float = 0.05, hidden: int = 16, batch_size: int = 8):
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(FEATURES, hidden), torch.nn.LayerNorm(hidden),
                                       torch.nn.Tanh(), torch.nn.Linear(hidden, 1))
        self.train_mae = torchmetrics.MeanAbsoluteError()
        self.val_mse = torchmetrics.MeanSquaredError()
        self.calls: list[str] = []
        self.seen: list[tuple[int, int]] = []
        self.losses: list[torch.Tensor] = []
        self.dtypes: tuple | None = None  # (first Linear's weight, model output) at the first training_step
        for name in HOOKS:  # instance attributes: Lightning's is_overridden() still sees the class
            setattr(self, name, _recording(self.calls, name, getattr(self, name)))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        pred = self(x)
        loss = F.mse_loss(pred.float(), y.float())
        self.seen.append((self.current_epoch, self.global_step))
        if self.dtypes is None:
            self.dtypes = (self.net[0].weight.dtype, pred.dtype)
        self.losses.append(loss.detach().float().cpu())
        self.train_mae(pred.float(), y.float())
        self.log("train_loss", loss, on_step=True, on_epoch=True, prog_bar=True)
        self.log("train_mae", self.train_mae, on_step=True, on_epoch=True)
        self.log("seen_epoch", float(self.current_epoch), on_step=True, on_epoch=False)
        self.log("seen_step", float(self.global_step), on_step=False, on_epoch=True, reduce_fx="max")
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        pred = self(x).float()
        self.val_mse(pred, y.float())
        self.log("val_loss", F.mse_loss(pred, y.float()), prog_bar=True)
        self.log("val_mse", self.val_mse, on_epoch=True)
        self.log("const", 1.0)  # never improves: what EarlyStopping cases watch
        self.log("val_epoch", float(self.current_epoch))  # a top-k order that no precision can change

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_loss", F.mse_loss(self(x).float(), y.float()))

    def predict_step(self, batch, batch_idx, dataloader_idx=0):
        return self(batch[0]).float()

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)
        return {"optimizer": opt, "lr_scheduler": scheduler_config(self.hparams.scheduler, opt)}

    def _loader(self, n: int, seed: int) -> DataLoader:
        return DataLoader(_dataset(n, seed), batch_size=self.hparams.batch_size)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1)  # shuffled, with its own generator: same order in both runs
        return DataLoader(_dataset(SAMPLES, 0), batch_size=self.hparams.batch_size, shuffle=True, generator=g)

    def val_dataloader(self):
        return self._loader(32, 10)

    def test_dataloader(self):
        return self._loader(32, 20)

    def predict_dataloader(self):
        return self._loader(16, 30)


class CompatDataModule(L.LightningDataModule):
    """The module's data as a LightningDataModule that records its hook calls in ``calls``."""

    HOOKS = ("prepare_data", "setup", "teardown", "train_dataloader", "val_dataloader", "test_dataloader",
             "predict_dataloader", "state_dict", "load_state_dict", "on_before_batch_transfer",
             "on_after_batch_transfer", "transfer_batch_to_device")

    def __init__(self, batch_size: int = 8):
        super().__init__()
        self.batch_size = batch_size
        self.calls: list[str] = []
        for name in self.HOOKS:
            setattr(self, name, _recording(self.calls, name, getattr(self, name)))

    def train_dataloader(self):
        g = torch.Generator().manual_seed(2)
        return DataLoader(_dataset(SAMPLES, 1), batch_size=self.batch_size, shuffle=True, generator=g)

    def val_dataloader(self):
        return DataLoader(_dataset(24, 11), batch_size=self.batch_size)

    def test_dataloader(self):
        return DataLoader(_dataset(24, 21), batch_size=self.batch_size)

    def predict_dataloader(self):
        return DataLoader(_dataset(8, 31), batch_size=self.batch_size)
