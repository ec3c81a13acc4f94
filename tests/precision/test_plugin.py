"""The plugins under plain lightning.Trainer: every mode trains, strings and arguments are checked,
LR schedulers drive the masters, clipping sees unscaled grads, an accumulation window is skipped whole."""
from __future__ import annotations

import pytest
import torch

from _models import Classifier, mlp
from _plain_lightning import StepRecorder, loader, trainer
from mptrain.precision import (PRECISIONS, DynamicLossScaler, MasterPrecision, MixedPrecision, TruePrecision,
                               normalize_precision, precision_plugin)

PARAM_DTYPE = {"32-true": torch.float32, "16-mixed": torch.float32, "bf16-mixed": torch.float32,
               "16-true": torch.float16, "bf16-true": torch.bfloat16, "16-master": torch.float16,
               "bf16-master": torch.bfloat16, "bf16-sr": torch.bfloat16}


# fp8-master needs an fp8 GPU: its CPU refusal and plugin logic are in tests/precision/test_fp8.py
@pytest.mark.parametrize("name", [p for p in PRECISIONS if p != "fp8-master"])
def test_every_mode_trains_under_plain_lightning(name):
    torch.manual_seed(0)
    # SGD: AdamW's eps=1e-8 is 0 in fp16, which breaks 16-true (as under Lightning's own plugin)
    model = Classifier(mlp(), lr=0.1, optimizer="sgd")
    plugin = precision_plugin(name, loss_scaler={"init_scale": 256.0} if name.startswith("16-") and
                              not name.endswith("true") else None)
    rec = StepRecorder()
    t = trainer(plugin, max_steps=4, callbacks=[rec])
    t.fit(model, loader())
    assert t.global_step == 4 and plugin.skipped_steps == 0 and plugin.precision == name
    assert model.net[0].weight.dtype == PARAM_DTYPE[name]
    want_norm = torch.float32 if name.endswith("master") or name == "bf16-sr" else PARAM_DTYPE[name]
    assert model.net[1].weight.dtype == want_norm  # the LayerNorm keeps fp32 in master modes and bf16-sr
    assert all(not rec.unchanged(k) for k in range(4))
    losses = torch.stack(model.losses).float()
    assert torch.isfinite(losses).all() and losses[-1] < losses[0]


def test_strings_aliases_and_bad_arguments():
    assert normalize_precision(32) == normalize_precision("32") == "32-true"
    assert normalize_precision(16) == normalize_precision("16") == "16-mixed"
    assert normalize_precision("bf16") == "bf16-mixed"
    for bad in ("64-true", 64, "fp16", None):
        with pytest.raises(ValueError, match="Valid values: 32-true, 16-mixed"):
            normalize_precision(bad)
    assert type(precision_plugin("bf16-master")) is MasterPrecision
    assert type(precision_plugin("bf16")) is MixedPrecision
    assert type(precision_plugin(32)) is TruePrecision
    with pytest.raises(ValueError, match=r"MasterPrecision\(precision='bf16-mixed'\).*'16-master', 'bf16-master'"):
        MasterPrecision("bf16-mixed")
    with pytest.raises(ValueError, match="'32-true', '16-true', 'bf16-true'"):
        TruePrecision("bf16-master")
    with pytest.raises(ValueError, match="uses no loss scaler"):
        TruePrecision("bf16-true", loss_scaler={"init_scale": 8.0})
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['init_scal'\]"):
        MixedPrecision("16-mixed", loss_scaler={"init_scal": 2})
    with pytest.raises(ValueError, match="init_scale=-2"):
        MasterPrecision("16-master", loss_scaler={"init_scale": -2})
    with pytest.raises(ValueError, match="fused='yes'"):
        MasterPrecision("bf16-master", fused="yes")
    with pytest.raises(ValueError, match="unknown op 'softmaxx'"):
        TruePrecision("32-true", fp32_fallback=["softmaxx"])
    # the mode's default scaler (DESIGN §2), off, an object, a dict
    assert isinstance(precision_plugin("16-master").loss_scaler, DynamicLossScaler)
    assert isinstance(precision_plugin("16-mixed").loss_scaler, DynamicLossScaler)
    assert precision_plugin("bf16-master").loss_scaler is None
    assert precision_plugin("16-master", loss_scaler=False).loss_scaler is None
    assert precision_plugin("16-master", loss_scaler="off").loss_scaler is None
    s = DynamicLossScaler(init_scale=4.0)
    assert precision_plugin("bf16-master", loss_scaler=s).loss_scaler is s
    assert precision_plugin("bf16-mixed", loss_scaler={"init_scale": 8.0}).loss_scaler.scale == 8.0
    assert precision_plugin("bf16-true", max_consecutive_skips=3).guard.max_consecutive_skips == 3


class PlainSGD(Classifier):
    """SGD without momentum and a StepLR halving the LR every step: master delta == lr_t * grad."""

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.5)
        return [opt], [{"scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5), "interval": "step"}]


def test_lr_scheduler_drives_the_masters():
    torch.manual_seed(0)
    model = PlainSGD(mlp())
    plugin = MasterPrecision("bf16-master")
    seen = []

    class Grab(StepRecorder):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            masters = [p.detach().clone() for g in optimizer.param_groups for p in g["params"]]
            seen.append((optimizer.param_groups[0]["lr"], masters, {n: g.clone() for n, g in plugin.unscaled_grads().items()}))

    t = trainer(plugin, max_steps=3, callbacks=[Grab()])
    t.fit(model, loader())
    opt = t.optimizers[0]
    masters = [p for g in opt.param_groups for p in g["params"]]
    assert all(m.dtype == torch.float32 for m in masters)
    assert [s[0] for s in seen] == [0.5, 0.25, 0.125] and opt.param_groups[0]["lr"] == 0.0625
    names = [n for n, _ in model.named_parameters()]
    for (lr, before, grads), after in zip(seen, [s[1] for s in seen[1:]] + [[m.detach() for m in masters]]):
        for n, b, a in zip(names, before, after):
            torch.testing.assert_close(a, b - lr * grads[n], rtol=0, atol=1e-7)


@pytest.mark.parametrize("name,algo", [("16-master", "norm"), ("16-mixed", "norm"), ("bf16-master", "value"),
                                       ("16-master", "value")])
def test_clipping_sees_unscaled_grads(name, algo):
    torch.manual_seed(0)
    model = Classifier(mlp())
    model.configure_optimizers = lambda: torch.optim.SGD(model.parameters(), lr=1.0)
    clip = 1e-2
    plugin = precision_plugin(name, loss_scaler={"init_scale": 1024.0} if name.startswith("16") else None)
    rec = StepRecorder()
    masters = []

    class Masters(StepRecorder):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            masters.append([p.detach().clone() for g in optimizer.param_groups for p in g["params"]])

    t = trainer(plugin, max_steps=2, callbacks=[rec, Masters()], gradient_clip_val=clip,
                gradient_clip_algorithm=algo)
    t.fit(model, loader())
    opt = t.optimizers[0]
    final = [p.detach() for g in opt.param_groups for p in g["params"]]
    delta = [a - b for a, b in zip(final, masters[1])]  # the last step's update == -clipped grads
    if algo == "norm":
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(d.float()) for d in delta]))
        assert clip * 0.9 < float(norm) <= clip * 1.01  # clipped to the norm of the unscaled grads
    else:
        biggest = max(float(d.float().abs().max()) for d in delta)
        assert clip * 0.5 < biggest <= clip * 1.01


@pytest.mark.parametrize("name", ["bf16-master", "16-master", "16-mixed", "32-true"])
def test_overflow_anywhere_in_the_window_skips_the_whole_window(name):
    torch.manual_seed(0)
    # batch 2 is the first micro-batch of the second window (accumulate_grad_batches=2)
    model = Classifier(mlp(), inf_at_batches={(1, 2)})
    plugin = precision_plugin(name, loss_scaler={"init_scale": 256.0} if name.startswith("16") else None)
    rec = StepRecorder()
    half_grads_after = {}

    class HalfGrads(StepRecorder):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx == 3:
                half_grads_after[trainer.global_step] = [p.grad for p in pl_module.parameters() if p.dtype != torch.float32]

    t = trainer(plugin, max_steps=3, accumulate_grad_batches=2, callbacks=[rec, HalfGrads()])
    t.fit(model, loader(n=192))
    assert rec.unchanged(1) and not rec.unchanged(0) and not rec.unchanged(2)
    assert plugin.skipped_steps == 1 and t.global_step == 3  # global_step counts it, as Lightning does
    if name.endswith("master"):  # the skipped window's half grads are cleared with it
        assert half_grads_after[2] and all(g is None for g in half_grads_after[2])


def test_lbfgs_is_refused_at_setup():
    model = Classifier(mlp())
    model.configure_optimizers = lambda: torch.optim.LBFGS(model.parameters())
    with pytest.raises(ValueError, match="LBFGS"):
        trainer(MasterPrecision("bf16-master"), max_steps=1).fit(model, loader())


def test_fused_path_folds_norm_clipping_into_the_step():
    from mptrain.optim import FusedSGD

    torch.manual_seed(0)
    model = Classifier(mlp())
    model.configure_optimizers = lambda: FusedSGD(model.parameters(), lr=1.0)
    plugin = MasterPrecision("16-master", loss_scaler={"init_scale": 1024.0})
    before = []

    class Masters(StepRecorder):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            before.append({n: optimizer.master_param(p).detach().clone() if optimizer.uses_master(p) else
                           p.detach().clone() for n, p in pl_module.named_parameters()})

    t = trainer(plugin, max_steps=2, callbacks=[Masters()], gradient_clip_val=1e-2)
    t.fit(model, loader())
    opt = t.optimizers[0]
    after = {n: opt.master_param(p) if opt.uses_master(p) else p.detach() for n, p in model.named_parameters()}
    delta = torch.stack([torch.linalg.vector_norm(after[n] - before[1][n]) for n in after])
    assert 0.9e-2 < float(torch.linalg.vector_norm(delta)) <= 1.01e-2 and plugin.skipped_steps == 0


class Manual(Classifier):
    """Manual optimization with clipping: SGD(lr=1) makes the master update the clipped grad."""

    def __init__(self, net):
        super().__init__(net, lr=1.0, optimizer="sgd")
        self.automatic_optimization = False

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1.0)

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self(x), y)
        if batch_idx == 1:
            loss = loss * float("inf")
        opt.zero_grad()
        self.manual_backward(loss)
        self.clip_gradients(opt, gradient_clip_val=1e-3, gradient_clip_algorithm="norm")
        opt.step()
        return loss


@pytest.mark.parametrize("name", ["bf16-master", "16-mixed"])
def test_manual_optimization(name):
    torch.manual_seed(0)
    model = Manual(mlp())
    plugin = precision_plugin(name, loss_scaler={"init_scale": 256.0} if name.startswith("16") else None)
    snaps = []

    class Snap(StepRecorder):  # what the optimizer steps: the fp32 masters in bf16-master
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            snaps.append([p.detach().clone() for g in trainer.optimizers[0].param_groups for p in g["params"]])

    trainer(plugin, max_epochs=1, limit_train_batches=3, callbacks=[Snap()]).fit(model, loader())
    changed = [not all(torch.equal(a, b) for a, b in zip(snaps[k], snaps[k + 1])) for k in range(2)]
    assert changed == [True, False] and plugin.skipped_steps == 1
    assert all(p.dtype == torch.float32 for p in snaps[0])
    # SGD(lr=1): the first update is the clipped, unscaled grad itself
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(a - b) for a, b in zip(snaps[1], snaps[0])]))
    assert 0.9e-3 < float(norm) <= 1.01e-3


def test_validate_and_predict_after_fit_keep_the_conversion_once():
    torch.manual_seed(0)
    model = Classifier(mlp())
    t = trainer(MasterPrecision("bf16-master"), max_steps=2)
    t.fit(model, loader())
    metrics = t.validate(model, loader(), verbose=False)[0]
    assert set(metrics) == {"val_loss", "val_acc"} and all(v == v for v in metrics.values())
    preds = t.predict(model, torch.utils.data.DataLoader(loader().dataset.tensors[0], batch_size=32))
    assert preds[0].dtype == torch.bfloat16 and preds[0].shape == (32, 4)
