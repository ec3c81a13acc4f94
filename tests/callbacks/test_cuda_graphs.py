"""cuda_graphs=True on the CPU: every setup-time refusal, the error for a failed capture, and the wiring.

Real captures need a GPU (tests/gpu/test_cuda_graphs_cuda.py).  Here the graphed forward and the graphed
optimizer step run inside real ``lightning.Trainer`` fits: in their eager warm-up path, which must
train exactly like the plain plugin; and captured and replayed on a CPU emulation of CUDA graphs
(``_graph_emulator.py``), which must train like eager too (losses, weights, skipped steps), whether
``training_step`` calls ``self(x)`` or the network where it lives (``self.net(x)``, a user's
``self.model(...)`` around transformers' BERT).  Their checks (inputs, calls, hooks, hyperparameters,
host syncs) fire.
"""
from __future__ import annotations

import sys
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import GradientAccumulationScheduler

from _models import Classifier, classification_data, mlp
from mptrain.callbacks.compile_model import CompileModel
from mptrain.callbacks.cuda_graphs import CudaGraphs, check_last_batch, check_optimizers, check_trainer
from mptrain.callbacks.fp32_finetune import Fp32Finetune
from mptrain.callbacks.graph_safety import refuse_module_hooks
from mptrain.callbacks.graphed_forward import GraphedForward
from mptrain.precision import MasterPrecision, precision_plugin
from mptrain.precision.graph_capture import CudaGraphError, describe_capture_error
from mptrain.precision.graphed_step import GraphedStep, _check_hyperparameters, _hyperparameters


def _loader(n=96, bs=16, **kw):
    return torch.utils.data.DataLoader(classification_data(n=n), batch_size=bs, **kw)


def _fit(model, callbacks=(), plugin=None, **kw):
    for k, v in dict(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, max_steps=4,
                     enable_checkpointing=False, enable_model_summary=False).items():
        kw.setdefault(k, v)
    plugin = plugin or MasterPrecision("bf16-master")
    trainer = L.Trainer(plugins=[plugin], callbacks=list(callbacks), **kw)
    trainer.fit(model, _loader())
    return trainer


class Manual(Classifier):
    def __init__(self):
        super().__init__(mlp())
        self.automatic_optimization = False


@pytest.mark.parametrize("case,kw,match", [
    ("cpu", {}, r"trains on cpu.*accelerator='cuda'"),
    ("manual", {}, r"manual optimization"),
    ("accumulation", dict(accumulate_grad_batches=2), r"gradient accumulation \(accumulate_grad_batches=2"),
    ("accumulation scheduler", dict(callbacks=[GradientAccumulationScheduler({0: 1})]),
     r"GradientAccumulationScheduler"),
    ("fp32 finetune", dict(callbacks=[Fp32Finetune(steps=2)]), r"Fp32Finetune.*changes parameter dtypes"),
    ("compile reduce-overhead", dict(callbacks=[CompileModel(mode="reduce-overhead")]), r"cudagraph trees"),
    ("compile cudagraphs option", dict(callbacks=[CompileModel(options={"triton.cudagraphs": True})]),
     r"compile=\{'options': \{'triton.cudagraphs': True\}\} captures CUDA graphs itself"),
    ("detect_anomaly", dict(detect_anomaly=True), r"detect_anomaly=True"),
])
def test_refused_at_setup_before_any_step(case, kw, match):
    model = Manual() if case == "manual" else Classifier(mlp())
    before = [p.detach().clone() for p in model.parameters()]
    callbacks = [CudaGraphs()] + kw.pop("callbacks", [])
    with pytest.raises(CudaGraphError, match=match) as err:
        _fit(model, callbacks=callbacks, **kw)
    assert "cuda_graphs=False" in str(err.value)
    assert all(torch.equal(a, b.float()) for a, b in zip(before, model.parameters()))  # no step was taken


def test_refuses_several_devices():
    model = Classifier(mlp())
    trainer = L.Trainer(plugins=[MasterPrecision("bf16-master")], accelerator="cpu", devices=2, strategy="ddp",
                        logger=False, enable_progress_bar=False)
    with pytest.raises(CudaGraphError, match=r"DDPStrategy on 2 device\(s\).*devices=1"):
        check_trainer(trainer, model, trainer.precision_plugin)


def test_needs_an_mptrain_precision_plugin():
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, max_steps=1,
                        callbacks=[CudaGraphs()])
    with pytest.raises(TypeError, match="CudaGraphs needs one of mptrain's precision plugins"):
        trainer.fit(Classifier(mlp()), _loader())


def test_warmup_steps_must_be_positive():
    with pytest.raises(ValueError, match=r"warmup_steps=0.*integer >= 1"):
        CudaGraphs(warmup_steps=0)


def _params():
    return [torch.nn.Parameter(torch.randn(3))]


@pytest.mark.parametrize("make,ok", [
    (lambda: torch.optim.AdamW(_params()), False),
    (lambda: torch.optim.AdamW(_params(), fused=True), False),
    (lambda: torch.optim.SGD(_params(), lr=0.1, fused=True), False),
    (lambda: torch.optim.AdamW(_params(), fused=True, capturable=True), True),
])
def test_optimizer_must_skip_on_the_device_and_be_capturable(make, ok):
    if ok:
        check_optimizers([make()])
        return
    with pytest.raises(CudaGraphError, match=r"torch\.optim\.\w+\.\w+ \(fused=\w+, capturable=\w+\).*fused=True, "
                                             r"capturable=True"):
        check_optimizers([make()])


def test_mptrain_fused_optimizers_pass_and_one_optimizer_only():
    from mptrain.optim import FusedAdamW

    check_optimizers([FusedAdamW(_params())])
    with pytest.raises(CudaGraphError, match="one optimizer, got 2"):
        check_optimizers([FusedAdamW(_params()), FusedAdamW(_params())])


@pytest.mark.parametrize("n,drop_last,max_steps,refused", [
    (100, False, -1, True), (100, True, -1, False), (96, False, -1, False), (100, False, 6, False),
])
def test_short_last_batch_refused_when_reached(n, drop_last, max_steps, refused):
    loader = _loader(n=n, drop_last=drop_last)
    trainer = SimpleNamespace(train_dataloader=loader, num_training_batches=len(loader), max_steps=max_steps)
    if not refused:
        check_last_batch(trainer)
        return
    with pytest.raises(CudaGraphError, match=r"last batch holds 4 samples \(100 samples, batch_size=16\).*drop_last"):
        check_last_batch(trainer)


def _user_line():
    raise RuntimeError("CUDA error: operation not permitted when stream is capturing")


def test_capture_error_names_the_first_error_the_user_line_and_the_fix():
    try:
        try:
            _user_line()
        finally:
            raise RuntimeError("CUDA error: operation failed due to a previous error during capture")
    except RuntimeError as exc:
        msg = describe_capture_error(exc, "the training forward", "Move it to training_step.")
    assert msg.startswith("cuda_graphs=True could not capture the training forward: RuntimeError: CUDA error: "
                          "operation not permitted when stream is capturing at ")
    assert "test_cuda_graphs.py" in msg and "in _user_line: `raise RuntimeError(" in msg
    assert ".item()" in msg and msg.endswith("Move it to training_step. Or train with cuda_graphs=False.")


def test_only_mptrain_module_hooks_may_be_graphed():
    net = mlp()
    MasterPrecision("bf16-master").convert_module(net)  # fp32 LayerNorm: mptrain's own hooks
    refuse_module_hooks(net)
    net[4].register_forward_hook(lambda m, a, out: None)
    with pytest.raises(CudaGraphError, match=r"module '4' has a forward hook \(.*<lambda>\).*run once, at capture"):
        refuse_module_hooks(net)


def test_hyperparameters_other_than_lr_are_fixed_after_capture():
    opt = torch.optim.AdamW(_params(), lr=1e-3)
    captured = _hyperparameters(opt)
    opt.param_groups[0]["lr"] = 5e-4  # followed through the lr buffer
    _check_hyperparameters(captured, opt)
    opt.param_groups[0]["betas"] = (0.8, 0.999)
    with pytest.raises(CudaGraphError, match=r"param group 0's 'betas' changed from \(0\.9, 0\.999\) to \(0\.8"):
        _check_hyperparameters(captured, opt)


class Wired(Callback):
    """The graphed forward and step of cuda_graphs=True, wired as CudaGraphs wires them (without its
    setup checks, which refuse the CPU)."""

    def __init__(self, warmup_steps: int = 10**6):
        self.warmup_steps, self.replays = warmup_steps, None

    def on_fit_start(self, trainer, pl_module):
        self.forward = GraphedForward(pl_module)
        self.step = GraphedStep(trainer.precision_plugin, warmup_steps=self.warmup_steps)
        self.step.around_closure = self.forward.training_step
        self.forward.install()
        self.step.install()

    def teardown(self, trainer, pl_module, stage):
        self.forward.uninstall()
        self.step.uninstall()
        self.replays = self.step.replays


@pytest.mark.parametrize("precision,scaler", [("bf16-master", None), ("16-master", {"init_scale": 2.0**10})])
def test_warm_up_path_trains_exactly_like_the_plugin(precision, scaler):
    runs = []
    for wired in (False, True):
        torch.manual_seed(0)
        model = Classifier(mlp(), inf_at_steps={2})
        plugin = MasterPrecision(precision, loss_scaler=scaler)
        trainer = _fit(model, callbacks=[Wired()] if wired else [], plugin=plugin, max_steps=5)
        runs.append((torch.stack(model.losses), [p.detach().clone() for p in model.parameters()],
                     plugin.skipped_steps, trainer.global_step, model))
    (l0, w0, s0, g0, _), (l1, w1, s1, g1, m1) = runs
    assert torch.equal(l0, l1) and all(torch.equal(a, b) for a, b in zip(w0, w1))
    assert (s0, g0) == (s1, g1) == (1, 5)
    plugin = trainer.precision_plugin
    assert "forward" not in m1.__dict__ and plugin.step_runner is None  # uninstalled
    assert "optimizer_step" not in plugin.__dict__  # the plugin is driven through its step phases, never patched


class TwoCalls(Classifier):
    def training_step(self, batch, batch_idx):
        self(batch[0])
        return super().training_step(batch, batch_idx)


class NoCall(Classifier):
    """Uses the network's layers one by one: no module a graph could hold is called."""

    def training_step(self, batch, batch_idx):
        h = batch[0]
        for layer in self.net:
            h = layer(h)
        return torch.nn.functional.cross_entropy(h, batch[1])


class ChildTwice(Classifier):
    def training_step(self, batch, batch_idx):
        self.net(batch[0])
        return torch.nn.functional.cross_entropy(self.net(batch[0]), batch[1])


class TwoChildren(Classifier):
    def __init__(self, net):
        super().__init__(net)
        self.head = torch.nn.Linear(4, 4)

    def training_step(self, batch, batch_idx):
        return torch.nn.functional.cross_entropy(self.head(self.net(batch[0])), batch[1])


class SwitchesModule(Classifier):
    def training_step(self, batch, batch_idx):
        logits = self(batch[0]) if batch_idx == 0 else self.net(batch[0])
        return torch.nn.functional.cross_entropy(logits, batch[1])


class ShapeChange(Classifier):
    def training_step(self, batch, batch_idx):
        x, y = batch
        if batch_idx == 2:
            x, y = x[:8], y[:8]
        return super().training_step((x, y), batch_idx)


@pytest.mark.parametrize("cls,match", [
    (TwoCalls, r"one forward call per training step; TwoCalls\.training_step called self\(\.\.\.\) again"),
    (NoCall, r"one network call of each training step: NoCall\.forward \(self\(\.\.\.\)\) or a direct submodule "
             r"with trainable parameters \(self\.net\(\.\.\.\)\), but NoCall\.training_step called none of them"),
    (ChildTwice, r"one forward call per training step; ChildTwice\.training_step called self\.net\(\.\.\.\) again"),
    (TwoChildren, r"one network call per training step, and TwoChildren\.training_step called self\.net\(\.\.\.\) "
                  r"and self\.head\(\.\.\.\): call one module that runs the whole network"),
    (SwitchesModule, r"graphs the module the first training step called \(self\(\.\.\.\)\), but at step 1 "
                     r"training_step called self\.net\(\.\.\.\)"),
    (ShapeChange, r"at step 2 forward input args\[0\] is a torch\.bfloat16 tensor of shape \(8, 16\) on cpu; the "
                  r"first steps had a torch\.bfloat16 tensor of shape \(16, 16\).*drop_last=True"),
])
def test_forward_checks_fire_during_warm_up(cls, match):
    with pytest.raises(CudaGraphError, match=match):
        _fit(cls(mlp()), callbacks=[Wired()])


def test_forward_outside_the_training_step_is_the_original():
    model = Classifier(mlp())
    graphed = GraphedForward(model)
    graphed.install()
    x = torch.randn(4, 16)
    torch.testing.assert_close(model(x), model.net(x))
    assert graphed.calls == 0
    graphed.uninstall()
    assert "forward" not in model.__dict__


def test_self_log_refused_inside_a_captured_forward_only():
    from mptrain.callbacks.graph_safety import refuse_logging

    model = Classifier(mlp())
    with refuse_logging(model), pytest.raises(CudaGraphError, match="forward calls self.log.*log in training_step"):
        model.log("x", 1.0)
    assert "log" not in model.__dict__ and "log_dict" not in model.__dict__


def test_optimizer_step_hooks_refused():
    from mptrain.optim import FusedAdamW

    opt = FusedAdamW(_params())
    opt.register_step_post_hook(lambda o, a, k: None)
    with pytest.raises(CudaGraphError, match=r"FusedAdamW has step hooks \(.*<lambda>\), which would run once"):
        check_optimizers([opt])


def _graphed_step_with(grads: dict) -> GraphedStep:
    step = GraphedStep(SimpleNamespace(), warmup_steps=1)
    step.grads = grads
    return step


def test_replayed_step_points_each_grad_at_its_captured_tensor():
    p, q, m = (torch.nn.Parameter(torch.zeros(2)) for _ in range(3))
    opt = torch.optim.SGD([p, q, m], lr=0.1)
    gp, gq, gm = torch.ones(2), torch.zeros(2), torch.zeros(2)
    step = _graphed_step_with({id(p): (gp, False), id(q): (gq, False), id(m): (gm, True)})
    eager = torch.full((2,), 3.0)
    p.grad, q.grad, m.grad = gp, eager, None  # written by the graphed backward / made eagerly / cleared by zero_grad
    step._point_grads(opt)
    assert p.grad is gp and q.grad is gq and m.grad is gm
    assert torch.equal(gq, eager)  # the eager grad is copied into the tensor the captured step reads


@pytest.mark.parametrize("missing", [True, False])
def test_replayed_step_refuses_a_changed_set_of_parameters_with_grads(missing):
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([p], lr=0.1)
    step = _graphed_step_with({id(p): (torch.zeros(2), False)} if missing else {})
    p.grad = None if missing else torch.zeros(2)
    with pytest.raises(CudaGraphError, match=f"shape \\(2,\\) {'has no gradient' if missing else 'has a gradient'}"):
        step._point_grads(opt)


class InfGrad(Callback):
    """Writes an inf into one gradient after the backward of ``step`` (the loss stays finite)."""

    def __init__(self, step: int):
        self.step = step

    def on_after_backward(self, trainer, pl_module):
        if trainer.global_step == self.step:
            next(p for p in pl_module.parameters() if p.grad is not None).grad.view(-1)[0] = float("inf")


class Scheduled(Classifier):
    """AdamW (mptrain's fused, or torch's fused) with an LR that changes every step; at ``inf_loss_at`` the
    loss is inf while the gradients stay finite (only the loss's non-finite flag can skip that step)."""

    def __init__(self, opt: str, inf_loss_at: int):
        super().__init__(mlp())
        self.opt, self.inf_loss_at = opt, inf_loss_at

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss + float("inf") if self.trainer.global_step == self.inf_loss_at else loss

    def configure_optimizers(self):
        from mptrain.optim import FusedAdamW

        # fused=False: on the CPU the custom op reads the captured step's lr tensor as a float (a host read to the
        # emulator), where CUDA reads it on the device; the reference path computes with the tensor
        opt = FusedAdamW(self.parameters(), lr=1e-2, fused=False) if self.opt == "mptrain" else \
            torch.optim.AdamW(self.parameters(), lr=1e-2, fused=True)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


@pytest.mark.parametrize("precision,opt,clip", [
    ("bf16-master", "mptrain", None), ("16-master", "mptrain", 0.5), ("bf16-master", "torch", 0.5),
    ("32-true", "torch", None),
])
def test_emulated_replays_train_exactly_like_eager(monkeypatch, precision, opt, clip):
    """Captured at step 2 and replayed on a CPU emulation of CUDA graphs (tests/callbacks/_graph_emulator.py):
    the same losses, weights, skips (an inf loss at step 4, an inf grad at step 6), LR schedule and clipping."""
    from _graph_emulator import emulate_cuda_graphs

    runs = []
    for graphs in (False, True):
        if graphs:
            emulate_cuda_graphs(monkeypatch)
        torch.manual_seed(0)
        model = Scheduled(opt, inf_loss_at=4)
        wired = Wired(warmup_steps=2)
        plugin = precision_plugin(precision, **({"loss_scaler": {"init_scale": 2.0**10}} if precision == "16-master"
                                                else {}))
        trainer = _fit(model, callbacks=[InfGrad(6)] + ([wired] if graphs else []), plugin=plugin, max_steps=9,
                       gradient_clip_val=clip)
        runs.append((model, trainer, wired))
    (m0, t0, _), (m1, t1, wired) = runs
    assert wired.replays == 9 - 2
    assert t0.precision_plugin.skipped_steps == t1.precision_plugin.skipped_steps == 2
    assert torch.equal(torch.stack(m0.losses), torch.stack(m1.losses))
    for (name, a), b in zip(m0.state_dict().items(), m1.state_dict().values()):
        # torch's fused AdamW rounds a tensor lr (the captured step's) and a float lr one ulp apart
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7, msg=name)


class ViaChild(Scheduled):
    """training_step calls self.net(x), not self(x); also a parameterless child (the loss) and a parameter of the
    LightningModule's own, both used eagerly around the graphed call."""

    def __init__(self, opt: str, inf_loss_at: int):
        super().__init__(opt, inf_loss_at)
        self.loss_fn = torch.nn.CrossEntropyLoss()
        self.scale = torch.nn.Parameter(torch.ones(()))

    def forward(self, x):
        raise AssertionError("training_step calls self.net")

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = self.loss_fn(self.net(x) * self.scale, y)
        self.losses.append(loss.detach().float())
        return loss + float("inf") if self.trainer.global_step == self.inf_loss_at else loss


def _emulated_runs(monkeypatch, make_model, precision="bf16-master", max_steps=9, fit_callbacks=(), **fit_kw):
    """The same seeded run eager and on the emulated graphs (captured at step 2): (model, trainer, wired) each."""
    from _graph_emulator import emulate_cuda_graphs

    runs = []
    for graphs in (False, True):
        if graphs:
            emulate_cuda_graphs(monkeypatch)
        torch.manual_seed(0)
        model = make_model()
        wired = Wired(warmup_steps=2)
        callbacks = [InfGrad(6), *fit_callbacks] + ([wired] if graphs else [])
        trainer = _fit(model, callbacks=callbacks, plugin=precision_plugin(precision), max_steps=max_steps, **fit_kw)
        runs.append((model, trainer, wired))
    return runs


def _same_training(runs, rtol=1e-6, atol=1e-7):
    (m0, t0, _), (m1, t1, _) = runs
    assert t0.precision_plugin.skipped_steps == t1.precision_plugin.skipped_steps
    assert torch.equal(torch.stack(m0.losses), torch.stack(m1.losses))
    for (name, a), b in zip(m0.state_dict().items(), m1.state_dict().values()):
        torch.testing.assert_close(b, a, rtol=rtol, atol=atol, msg=name)


@pytest.mark.parametrize("opt", ["mptrain", "torch"])
def test_emulated_replays_of_self_net_train_exactly_like_eager(monkeypatch, opt):
    """The graphed module is the child training_step calls: captured, replayed, the same losses, weights and skips;
    the LightningModule's own parameter, used eagerly, gets its gradient too."""
    runs = _emulated_runs(monkeypatch, lambda: ViaChild(opt, inf_loss_at=4), gradient_clip_val=0.5)
    (m0, _, _), (m1, t1, wired) = runs
    assert wired.replays == 9 - 2 and wired.forward.target.call == "self.net(...)"
    assert t1.precision_plugin.skipped_steps == 2
    _same_training(runs)
    assert not torch.equal(m1.scale.detach().float(), torch.ones(()))  # trained through the eager part
    assert "forward" not in m1.net.__dict__ and "forward" not in m1.__dict__  # uninstalled


def test_emulated_replays_of_a_child_compiled_in_place_train_like_eager(monkeypatch):
    """compile=True compiles self.model in place: the graphed wrapper goes on its compiled call (a wrapper on its
    forward would be traced into the compiled code), and the captured step replays the compiled kernels."""
    class Compiled(ViaChild):
        def __init__(self):
            super().__init__("torch", inf_loss_at=4)
            self.model = self.net  # what compile=True compiles; the steps call it as self.net

    runs = _emulated_runs(monkeypatch, Compiled, max_steps=7, fit_callbacks=[CompileModel(backend="eager")])
    wired = runs[1][2]
    assert wired.replays == 7 - 2 and wired.forward.target.attr == "_compiled_call_impl"
    _same_training(runs)
    assert runs[1][0].net._compiled_call_impl is not None  # put back after the run


class UserBert(L.LightningModule):
    """transformers' BertForMaskedLM as a user stores it: self.model(...) returns a MaskedLMOutput with the loss."""

    def __init__(self):
        super().__init__()
        from transformers import BertConfig, BertForMaskedLM

        self.model = BertForMaskedLM(BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1,
                                                num_attention_heads=2, intermediate_size=32, hidden_dropout_prob=0.0,
                                                attention_probs_dropout_prob=0.0, attn_implementation="sdpa"))
        self.losses: list = []

    def training_step(self, batch, batch_idx):
        loss = self.model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
        self.losses.append(loss.detach())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2, fused=True)


def test_emulated_user_bert_calling_self_model_replays_like_eager(monkeypatch):
    """A plain LightningModule around BertForMaskedLM (a ModelOutput out, the loss inside the graphed call)."""
    from _graph_emulator import emulate_cuda_graphs
    from mptrain.bench.e2e_models import mlm_batches

    runs = []
    for graphs in (False, True):
        if graphs:
            emulate_cuda_graphs(monkeypatch)
        torch.manual_seed(0)
        model, wired = UserBert(), Wired(warmup_steps=2)
        trainer = L.Trainer(plugins=[MasterPrecision("bf16-master")], accelerator="cpu", devices=1, max_steps=6,
                            logger=False, enable_progress_bar=False, enable_checkpointing=False,
                            enable_model_summary=False, callbacks=[wired] if graphs else [])
        trainer.fit(model, mlm_batches(4, 6, "cpu", seq_len=8, vocab=50))
        runs.append((model, trainer, wired))
    assert runs[1][2].replays == 6 - 2 and runs[1][2].forward.target.call == "self.model(...)"
    _same_training(runs)


def test_emulated_tiny_bert_replays_like_eager(monkeypatch):
    """BertMLM (dict batch, four outputs of which the loss uses one, fused LayerNorm, warm-up LR schedule) captured
    at step 2 on the CPU emulation: the same losses and weights as eager, an inf loss at step 4 skipped."""
    from _graph_emulator import emulate_cuda_graphs
    from mptrain.bench.e2e_models import mlm_batches
    from mptrain.models.bert import BertMLM

    class Bert(BertMLM):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            self.losses.append(loss.detach())
            return loss + float("inf") if self.trainer.global_step == 4 else loss

        def configure_optimizers(self):  # the recipe's, with the fused AdamW it picks on CUDA
            from mptrain.models.optim import decay_groups
            from mptrain.models.schedules import per_step, warmup_linear
            from mptrain.optim import FusedAdamW

            opt = FusedAdamW(decay_groups(self, 0.01), lr=1e-2, fused=False)  # as in Scheduled
            return {"optimizer": opt, "lr_scheduler": per_step(warmup_linear(opt, 3, lambda: 7))}

    runs = []
    for graphs in (False, True):
        if graphs:
            emulate_cuda_graphs(monkeypatch)
        torch.manual_seed(0)
        model = Bert(vocab_size=50, hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32, dropout=0.0,
                     max_predictions=3, warmup_steps=3, total_steps=7)
        model.losses = []
        wired = Wired(warmup_steps=2)
        trainer = L.Trainer(plugins=[MasterPrecision("bf16-master")], accelerator="cpu", devices=1, max_steps=7,
                            logger=False, enable_progress_bar=False, enable_checkpointing=False,
                            enable_model_summary=False, callbacks=[wired] if graphs else [])
        trainer.fit(model, mlm_batches(4, 7, "cpu", seq_len=8, vocab=50))
        runs.append((model, trainer, wired))
    (m0, t0, _), (m1, t1, wired) = runs
    assert wired.replays == 7 - 2 and t0.precision_plugin.skipped_steps == t1.precision_plugin.skipped_steps == 1
    assert torch.equal(torch.stack(m0.losses), torch.stack(m1.losses))
    for (name, a), b in zip(m0.state_dict().items(), m1.state_dict().values()):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7, msg=name)


def test_emulated_host_sync_in_forward_fails_at_capture_naming_the_line(monkeypatch):
    from _graph_emulator import emulate_cuda_graphs

    from mptrain.optim import FusedAdamW

    class Syncing(Classifier):
        def forward(self, x):
            return self.net(x[x.sum(1) > -1e9])  # boolean-mask indexing: the row count is read on the host

        def configure_optimizers(self):
            return FusedAdamW(self.parameters())

    emulate_cuda_graphs(monkeypatch)
    with pytest.raises(CudaGraphError, match=r"could not capture the training forward: RuntimeError: .*aten\.index\) at "
                                             r".*test_cuda_graphs\.py:\d+ in forward: `return self\.net\(x\[x\.sum"):
        _fit(Syncing(mlp()), callbacks=[Wired(warmup_steps=2)])


def test_a_model_compiled_with_cudagraph_trees_is_refused_at_capture(monkeypatch):
    import types

    from mptrain.callbacks.graph_safety import refuse_cudagraph_trees

    trees = types.ModuleType("torch._inductor.cudagraph_trees")
    managers = {}
    trees.get_manager = lambda device, create_if_none_exists=True: managers.get(device)
    monkeypatch.setitem(sys.modules, "torch._inductor.cudagraph_trees", trees)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    refuse_cudagraph_trees()  # no manager: cudagraph trees never ran
    managers[0] = object()
    with pytest.raises(CudaGraphError, match=r"torch\.compile's own CUDA graphs \(cudagraph trees.*default mode"):
        refuse_cudagraph_trees()


def test_emulated_a_check_made_inside_training_step_is_refused_at_capture(monkeypatch):
    """Clipping right after backward unscales and checks the grads before the step: that check could not be part
    of the captured step, so the capture refuses it instead of replaying a step without it."""
    from _graph_emulator import emulate_cuda_graphs

    from mptrain.optim import FusedAdamW

    class ClipsItself(Classifier):
        def on_after_backward(self):
            self.clip_gradients(self.optimizers(), gradient_clip_val=1.0)

        def configure_optimizers(self):
            return FusedAdamW(self.parameters())

    emulate_cuda_graphs(monkeypatch)
    with pytest.raises(CudaGraphError, match=r"unscaled and checked before the optimizer step \(clip_gradients"):
        _fit(ClipsItself(mlp()), callbacks=[Wired(warmup_steps=2)])
