"""Trainer: every precision trains; accumulation; fp32 fine-tuning; argument errors."""
from __future__ import annotations

import math

import pytest
import torch

from _models import Classifier, classification_data, cnn, image_data, mlp, quiet_trainer
from mptrain import PRECISIONS, Trainer


def _loader(ds, bs, shuffle=True, seed=0):
    return torch.utils.data.DataLoader(ds, batch_size=bs, shuffle=shuffle, generator=torch.Generator().manual_seed(seed))


def _mean_loss(model, ds, precision_dtype=None):
    x, y = ds.tensors
    with torch.no_grad():
        model.eval()
        p = next(model.parameters())
        logits = model(x.to(p.dtype))
        return float(torch.nn.functional.cross_entropy(logits.float(), y))


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("arch", ["mlp", "cnn"])
def test_every_precision_trains(precision, arch):
    torch.manual_seed(0)
    ds = classification_data() if arch == "mlp" else image_data()
    net = mlp() if arch == "mlp" else cnn()
    # Adam's eps (1e-8) is zero in fp16, so 16-true (no fp32 state, as in Lightning) uses SGD.
    opt = "sgd" if precision == "16-true" else "adamw"
    model = Classifier(net, lr=0.1 if opt == "sgd" else 1e-2, optimizer=opt)
    before = _mean_loss(model, ds)
    trainer = quiet_trainer(precision=precision, max_epochs=4)
    trainer.fit(model, _loader(ds, 32))
    after = _mean_loss(model, ds)
    assert trainer.global_step == 4 * math.ceil(len(ds) / 32)
    assert math.isfinite(after) and after < 0.85 * before, (precision, arch, before, after)
    dtypes = {p.dtype for n, p in model.named_parameters()}
    expected = {"32-true": torch.float32, "16-mixed": torch.float32, "bf16-mixed": torch.float32,
                "16-true": torch.float16, "bf16-true": torch.bfloat16,
                "16-master": torch.float16, "bf16-master": torch.bfloat16}[precision]
    assert expected in dtypes
    assert trainer.precision == precision


def test_accumulation_equals_large_batch():
    ds = classification_data(n=64)
    results = []
    for bs, accum in [(32, 1), (8, 4)]:
        torch.manual_seed(0)
        model = Classifier(mlp(), lr=0.1, optimizer="sgd")
        trainer = quiet_trainer(precision="32-true", max_steps=2, accumulate_grad_batches=accum)
        trainer.fit(model, _loader(ds, bs, shuffle=False))
        assert trainer.global_step == 2
        results.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


@pytest.mark.parametrize("precision", ["16-mixed", "16-master"])
def test_overflow_in_one_microbatch_skips_the_window(precision):
    ds = classification_data(n=64)
    torch.manual_seed(0)
    # inf in micro-batch 2 (batch_idx 1) of the first window of 4
    model = Classifier(mlp(), lr=0.1, optimizer="sgd", inf_at_batches={(0, 1)})
    init = [p.detach().clone() for p in model.parameters()]
    seen = {}

    class Spy:
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx == 3:
                seen["params"] = [p.detach().float().clone() for p in pl_module.parameters()]
                seen["skipped"] = trainer.skipped_steps
                seen["grads"] = [p.grad for p in pl_module.parameters()]

    trainer = quiet_trainer(precision=precision, max_steps=2, accumulate_grad_batches=4, callbacks=[Spy()],
                            loss_scaler={"init_scale": 1024.0, "hysteresis": 1})
    trainer.fit(model, _loader(ds, 8, shuffle=False))
    for a, b in zip(init, seen["params"]):
        assert torch.equal(a.to(b.dtype) if a.dtype != b.dtype else a, b) or torch.equal(a.to(torch.float16).float(), b) or torch.equal(a.to(torch.bfloat16).float(), b)
    assert seen["skipped"] == 1
    assert all(g is None for g in seen["grads"]), "grads of a skipped window must be cleared"
    assert trainer.global_step == 2 and trainer.skipped_steps == 1
    assert trainer.loss_scaler.scale == 512.0


def test_partial_window_at_epoch_end_still_steps():
    ds = classification_data(n=40)  # 5 batches of 8: windows of 2 -> 2 full + 1 partial
    model = Classifier(mlp(), optimizer="sgd")
    trainer = quiet_trainer(max_epochs=2, accumulate_grad_batches=2)
    trainer.fit(model, _loader(ds, 8))
    assert trainer.global_step == 6


def _moments(opt):
    """exp_avg per parameter, in param-group order (state dict order may change at the switch)."""
    return [opt.state[p]["exp_avg"].clone() for g in opt.param_groups for p in g["params"] if p in opt.state]


def test_fp32_finetune_switch():
    ds = classification_data(n=128)
    torch.manual_seed(0)
    model = Classifier(mlp(), lr=3e-3)
    seen = []

    class Spy:
        def on_train_epoch_start(self, trainer, pl_module):
            st = _moments(trainer.optimizer)
            seen.append((trainer.current_epoch, trainer.precision, pl_module.net[0].weight.dtype,
                         pl_module.net[1].weight.dtype, st, len(pl_module.losses)))

        def on_train_epoch_end(self, trainer, pl_module):
            seen.append(("end", _moments(trainer.optimizer)))

    trainer = quiet_trainer(precision="bf16-master", max_epochs=4, fp32_finetune_epochs=1, callbacks=[Spy()])
    trainer.fit(model, _loader(ds, 32))
    starts = [s for s in seen if s[0] != "end"]
    assert [s[1] for s in starts] == ["bf16-master"] * 3 + ["32-true"]
    assert [s[2] for s in starts] == [torch.bfloat16] * 3 + [torch.float32]
    assert all(s[3] == torch.float32 for s in starts)  # norms stay fp32 throughout
    assert trainer.precision == "32-true" and trainer.loss_scaler is None
    # optimizer state carried over: the moments at the start of epoch 3 are those at the end of epoch 2
    end2 = [s for s in seen if s[0] == "end"][2][1]
    for a, b in zip(end2, starts[3][4]):
        assert torch.equal(a, b)
    # no loss spike at the switch
    losses = model.losses
    n = starts[3][5]
    assert max(losses[n : n + 2]) < 1.5 * max(losses[n - 2 : n])


def test_bad_arguments_name_the_key():
    with pytest.raises(ValueError, match="precision='fp8'.*32-true"):
        Trainer(precision="fp8")
    with pytest.raises(ValueError, match="accumulate_grad_batches"):
        Trainer(accumulate_grad_batches=0)
    with pytest.raises(ValueError, match="fused"):
        Trainer(fused="yes")
    with pytest.raises(NotImplementedError, match="cuda_graphs"):
        Trainer(cuda_graphs=True)
    with pytest.raises(ValueError, match="fp32_finetune_epochs"):
        Trainer(max_epochs=2, fp32_finetune_epochs=3)


def test_logging_reaches_callback_metrics_and_validation():
    ds = classification_data(n=64)
    model = Classifier(mlp())
    trainer = quiet_trainer(precision="bf16-mixed", max_epochs=2, log_every_n_steps=1)
    trainer.fit(model, _loader(ds, 16), _loader(ds, 32, shuffle=False))
    m = trainer.callback_metrics
    for key in ("train_loss", "train/loss", "lr", "val_loss", "val_acc", "samples_per_sec", "grad_norm"):
        assert key in m, key
    out = trainer.validate(model, _loader(ds, 32, shuffle=False))
    assert set(out[0]) == {"val_loss", "val_acc"}


def test_lr_scheduler_dict_form_steps_per_step():
    ds = classification_data(n=64)

    class WithSched(Classifier):
        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=1.0)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    model = WithSched(mlp())
    trainer = quiet_trainer(max_steps=3)
    trainer.fit(model, _loader(ds, 16))
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(0.125)


def test_should_stop_from_a_callback_ends_fit_after_the_step():
    class Stop:
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == 3:
                trainer.should_stop = True

    model = Classifier(mlp())
    trainer = quiet_trainer(max_epochs=5, callbacks=[Stop()])
    trainer.fit(model, _loader(classification_data(n=128), 16))
    assert trainer.global_step == 3
