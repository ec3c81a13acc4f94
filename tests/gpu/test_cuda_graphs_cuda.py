"""cuda_graphs=True on the GPU: the replayed step trains like the eager one (a tiny MLP, a small CNN with
BatchNorm, a tiny BERT with the fused LayerNorm and an LR schedule, a user's module calling self.model(...) around
torchvision's ResNet-18 or transformers' BERT with fuse_modules="auto"), skips a step with an inf loss and one
with an inf gradient on the device, never syncs with the host, and fails loudly where it cannot capture."""
from __future__ import annotations

import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch import Callback

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _models import Classifier, classification_data, cnn, image_data, mlp  # noqa: E402
from mptrain.callbacks.cuda_graphs import CudaGraphs  # noqa: E402
from mptrain.precision import precision_plugin  # noqa: E402
from mptrain.precision.graph_capture import CudaGraphError  # noqa: E402

STEPS, WARMUP = 12, 3


class InfGrad(Callback):
    """Writes an inf into one gradient after the backward of ``step`` (the loss stays finite)."""

    def __init__(self, step: int):
        self.step = step

    def on_after_backward(self, trainer, pl_module):
        if trainer.global_step == self.step:
            p = next(p for p in pl_module.parameters() if p.grad is not None)
            p.grad.view(-1)[0] = float("inf")


class Weights(Callback):
    """The module's params before and after every optimizer step."""

    def __init__(self):
        self.before, self.after = {}, {}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.before[trainer.global_step] = [p.detach().clone() for p in pl_module.parameters()]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.after[trainer.global_step - 1] = [p.detach().clone() for p in pl_module.parameters()]

    def unchanged(self, step):
        return all(torch.equal(a, b) for a, b in zip(self.before[step], self.after[step]))


def _fit(model, loader, precision, graphs, callbacks=(), max_steps=STEPS, **plugin_kw):
    graph_cb = CudaGraphs(warmup_steps=WARMUP)
    trainer = L.Trainer(plugins=[precision_plugin(precision, **plugin_kw)], accelerator="cuda", devices=1,
                        max_steps=max_steps, logger=False, enable_progress_bar=False, enable_checkpointing=False,
                        enable_model_summary=False, callbacks=list(callbacks) + ([graph_cb] if graphs else []))
    trainer.fit(model, loader)
    return trainer, graph_cb


def _device_loader(ds, bs):
    x, y = (t.cuda() for t in ds.tensors)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=bs)


def _optimizer(name):
    if name == "torch-fused":
        return lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True, capturable=True)
    from mptrain.optim import FusedAdamW

    return lambda ps: FusedAdamW(ps, lr=1e-2)


def _run(make_model, loader, precision, graphs, callbacks=(), **kw):
    torch.manual_seed(0)
    model = make_model()
    weights, inf_grad = Weights(), InfGrad(step=8)
    trainer, cb = _fit(model, loader, precision, graphs, callbacks=[weights, inf_grad, *callbacks], **kw)
    return model, trainer, cb, weights


@pytest.mark.parametrize("net,precision,opt", [
    ("mlp", "bf16-master", "mptrain"), ("mlp", "16-master", "mptrain"), ("mlp", "bf16-master", "torch-fused"),
    ("mlp", "32-true", "torch-fused"), ("mlp", "bf16-mixed", "mptrain"), ("cnn", "16-master", "mptrain"),
])
def test_replayed_steps_train_like_eager_and_skip_on_the_device(net, precision, opt):
    make_opt = _optimizer(opt)

    class M(Classifier):
        def training_step(self, batch, batch_idx):  # an inf loss with finite grads: only the loss flag skips it
            loss = super().training_step(batch, batch_idx)
            return loss + float("inf") if self.trainer.global_step == 5 else loss

        def configure_optimizers(self):
            return make_opt(self.parameters())

    data = classification_data(n=32 * STEPS) if net == "mlp" else image_data(n=16 * STEPS)
    loader = _device_loader(data, 32 if net == "mlp" else 16)
    kw = {"loss_scaler": {"init_scale": 2.0**8}} if precision == "16-master" else {}
    runs = [_run(lambda: M(mlp() if net == "mlp" else cnn()), loader, precision, graphs, **kw)
            for graphs in (False, True)]
    (m0, t0, _, w0), (m1, t1, cb, w1) = runs
    assert cb.replayed_steps == STEPS - WARMUP  # captured at step WARMUP, replayed from there on
    assert t0.global_step == t1.global_step == STEPS
    assert t0.precision_plugin.skipped_steps == t1.precision_plugin.skipped_steps == 2
    assert w1.unchanged(5) and w1.unchanged(8) and not w1.unchanged(9)  # both skipped on the device
    torch.testing.assert_close(torch.stack(m1.losses), torch.stack(m0.losses), rtol=1e-2, atol=1e-3)
    for (name, a), b in zip(m0.state_dict().items(), m1.state_dict().values()):  # fp32 masters, BN statistics
        torch.testing.assert_close(b.float(), a.float(), rtol=1e-2, atol=2e-3, msg=name)
    if precision == "16-master":
        assert t0.precision_plugin.loss_scaler.scale == t1.precision_plugin.loss_scaler.scale


def test_tiny_bert_bf16_master_with_fused_layernorm_and_lr_schedule():
    from mptrain.bench.e2e_models import mlm_batches
    from mptrain.models.bert import BertMLM

    class Bert(BertMLM):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            self.losses.append(loss.detach().float())
            return loss + float("inf") if self.trainer.global_step == 6 else loss  # finite grads

    def make():
        m = Bert(vocab_size=1000, hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128, dropout=0.0,
                 max_predictions=4, lr=1e-3, warmup_steps=4, total_steps=STEPS, fused_layernorm=True)
        m.losses = []
        return m

    loader = mlm_batches(8, STEPS, "cuda", seq_len=32, vocab=1000)
    (m0, t0, _, _), (m1, t1, cb, w1) = (_run(make, loader, "bf16-master", g) for g in (False, True))
    assert cb.replayed_steps == STEPS - WARMUP
    assert t0.precision_plugin.skipped_steps == t1.precision_plugin.skipped_steps == 2
    assert w1.unchanged(6) and w1.unchanged(8)
    assert len(m1.losses) == STEPS and len(set(round(float(v), 6) for v in m1.losses)) > 4  # the batches vary
    torch.testing.assert_close(torch.stack(m1.losses), torch.stack(m0.losses), rtol=1e-2, atol=1e-3)
    for (name, a), b in zip(m0.state_dict().items(), m1.state_dict().values()):
        torch.testing.assert_close(b.float(), a.float(), rtol=1e-2, atol=2e-3, msg=name)


def test_compile_default_mode_is_captured_too():
    from mptrain.callbacks.compile_model import CompileModel
    from mptrain.optim import FusedAdamW

    class M(Classifier):
        def __init__(self):
            super().__init__(mlp(), inf_at_steps={5})
            self.model = self.net  # what compile=True compiles

        def forward(self, x):
            return self.model(x)

        def configure_optimizers(self):
            return FusedAdamW(self.parameters(), lr=1e-2)

    loader = _device_loader(classification_data(n=32 * STEPS), 32)
    (m0, t0, _, _), (m1, t1, cb, w1) = (_run(M, loader, "bf16-master", g, callbacks=[CompileModel()] if g else [])
                                        for g in (False, True))
    assert m1.model._compiled_call_impl is not None  # compiled in place (state-dict keys unchanged)
    assert cb.replayed_steps == STEPS - WARMUP
    assert t1.precision_plugin.skipped_steps == 2 and w1.unchanged(5) and w1.unchanged(8)
    torch.testing.assert_close(torch.stack(m1.losses), torch.stack(m0.losses), rtol=2e-2, atol=2e-3)


class SyncGuard(Callback):
    """CUDA's sync debug mode "error" for the optimizer steps [start, stop)."""

    def __init__(self, start, stop):
        self.start, self.stop, self.guarded = start, stop, 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.start:
            torch.cuda.set_sync_debug_mode("error")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.guarded += self.start < trainer.global_step <= self.stop
        if trainer.global_step == self.stop:
            torch.cuda.set_sync_debug_mode("default")


def test_replayed_steps_never_sync_with_the_host():
    from mptrain.optim import FusedAdamW

    class M(Classifier):
        def configure_optimizers(self):
            return FusedAdamW(self.parameters(), lr=1e-3)

    guard = SyncGuard(start=WARMUP + 2, stop=WARMUP + 18)
    try:
        trainer, cb = _fit(M(mlp()), _device_loader(classification_data(n=64 * 24), 64), "16-master", True,
                           callbacks=[guard], max_steps=24)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert guard.guarded == 16 and cb.replayed_steps == 24 - WARMUP


class Batches:
    """32-row batches on the device; the one at ``short`` has 16 rows."""

    def __init__(self, short):
        self.short, self.ds = short, classification_data(n=32)

    def __len__(self):
        return 10

    def __iter__(self):
        x, y = (t.cuda() for t in self.ds.tensors)
        return ((x[:16], y[:16]) if i == self.short else (x, y) for i in range(10))


def test_a_changed_input_shape_after_capture_raises():
    from mptrain.optim import FusedAdamW

    class M(Classifier):
        def configure_optimizers(self):
            return FusedAdamW(self.parameters(), lr=1e-3)

    with pytest.raises(CudaGraphError, match=r"at step 6 forward input args\[0\] is a torch\.bfloat16 tensor of shape "
                                             r"\(16, 16\).*first steps had .*\(32, 16\)"):
        _fit(M(mlp()), Batches(short=6), "bf16-master", True)


def test_mptrain_trainer_cuda_graphs_true_adds_the_callback():
    from mptrain import Trainer
    from mptrain.optim import FusedAdamW

    class M(Classifier):
        def configure_optimizers(self):
            return FusedAdamW(self.parameters(), lr=1e-3)

    trainer = Trainer(precision="bf16-master", cuda_graphs=True, accelerator="cuda", devices=1, max_steps=6,
                      logger=False, enable_progress_bar=False, enable_checkpointing=False)
    trainer.fit(M(mlp()), _device_loader(classification_data(n=64 * 6), 64))
    cbs = [c for c in trainer.callbacks if isinstance(c, CudaGraphs)]
    assert len(cbs) == 1 and cbs[0].replayed_steps == 6 - cbs[0].warmup_steps


def test_host_sync_in_forward_fails_at_capture_naming_the_line():
    from mptrain.optim import FusedAdamW

    class Syncing(Classifier):
        def forward(self, x):
            return self.net(x[x.sum(1) > -1e9])  # boolean-mask indexing: the row count is read on the host

        def configure_optimizers(self):
            return FusedAdamW(self.parameters(), lr=1e-3)

    with pytest.raises(CudaGraphError, match=r"could not capture the training forward: .* at .*test_cuda_graphs_cuda\.py:"
                                             r"\d+ in forward: `return self\.net\(x\[x\.sum\(1\) > -1e9\]\)"):
        _fit(Syncing(mlp()), _device_loader(classification_data(n=64), 16), "bf16-master", True)
    torch.randn(4, device="cuda")  # the failed capture left the device's random generator usable


USER_VOCAB = 8195


class UserNet(L.LightningModule):
    """A plain user module: the network as ``self.model``, training_step calls ``self.model(...)`` (no forward),
    torch's fused, capturable AdamW."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind, self.losses = kind, []
        if kind == "resnet":
            import torchvision

            self.model = torchvision.models.resnet18(num_classes=10)
        else:
            from transformers import BertConfig, BertForMaskedLM

            # a ragged vocabulary with 2**20+ decoder weights: fuse_modules="auto" makes the decoder a PaddedLinear
            self.model = BertForMaskedLM(BertConfig(vocab_size=USER_VOCAB, hidden_size=128, num_hidden_layers=2,
                                                    num_attention_heads=2, intermediate_size=256,
                                                    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                                    attn_implementation="sdpa"))

    def training_step(self, batch, batch_idx):
        if self.kind == "resnet":
            loss = torch.nn.functional.cross_entropy(self.model(batch[0]), batch[1])
        else:
            loss = self.model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
        self.losses.append(loss.detach().float())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4, fused=True, capturable=True)  # smooth: cuDNN varies



@pytest.mark.parametrize("kind", ["resnet", "bert"])
def test_user_module_calling_self_model_is_captured_with_fused_modules(kind):
    """mptrain's Trainer on a user's own module: fuse_modules="auto" swaps its pool / LayerNorms and vocabulary
    decoder, cuda_graphs=True captures self.model(...) and replays it; the losses follow the eager run's."""
    from mptrain import FuseModules, Trainer
    from mptrain.bench.e2e_models import image_batches, mlm_batches
    from mptrain.nn import FusedLayerNorm, FusedMaxPool2d, PaddedLinear

    runs = []
    for graphs in (False, True):
        torch.manual_seed(0)
        model = UserNet(kind)
        loader = image_batches(16, STEPS, "cuda", image_size=32, num_classes=10) if kind == "resnet" else \
            mlm_batches(8, STEPS, "cuda", seq_len=32, vocab=USER_VOCAB)
        trainer = Trainer(precision="bf16-master", cuda_graphs=graphs, channels_last=kind == "resnet",
                          accelerator="cuda", devices=1, max_steps=STEPS, logger=False, enable_progress_bar=False,
                          enable_checkpointing=False, enable_model_summary=False)
        trainer.fit(model, loader)
        fuse = next(c for c in trainer.callbacks if isinstance(c, FuseModules))
        graph_cb = next((c for c in trainer.callbacks if isinstance(c, CudaGraphs)), None)
        runs.append((model, fuse, graph_cb))
    (m0, _, _), (m1, fuse, cb) = runs
    assert fuse.off_reason is None, fuse.off_reason
    if kind == "resnet":
        assert type(m1.model.maxpool) is FusedMaxPool2d
    else:
        assert type(m1.model.cls.predictions.decoder) is PaddedLinear
        assert type(m1.model.bert.encoder.layer[0].output.LayerNorm) is FusedLayerNorm
    assert cb.replayed_steps == STEPS - cb.warmup_steps > 0
    l0, l1 = torch.stack(m0.losses), torch.stack(m1.losses)
    assert torch.isfinite(l1).all() and len(set(round(float(v), 5) for v in l1)) > 4  # it trains, batches vary
    torch.testing.assert_close(l1, l0, rtol=3e-2, atol=3e-2)  # bf16; the captured BERT runs SDPA with a mask
