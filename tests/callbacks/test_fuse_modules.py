"""FuseModules / Trainer(fuse_modules=...): a user's own LightningModule (torchvision's ResNet, transformers' BERT
stored as ``self.model``) gets mptrain's fused modules at setup, with the same parameters, state-dict keys and
outputs; "auto" follows the run's mode and device; a CPU run trains exactly as without it."""
from __future__ import annotations

import logging
from types import SimpleNamespace

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from _models import quiet_trainer
from lightning.pytorch.plugins.precision import MixedPrecision as LightningMixed
from torch import nn

from mptrain.callbacks.compile_model import CompileModel
from mptrain.callbacks.fuse_modules import FuseModules
from mptrain.nn import FusedLayerNorm, FusedMaxPool2d, PaddedLinear
from mptrain.precision import MasterPrecision, precision_plugin

VOCAB, HIDDEN = 8195, 128  # a ragged vocabulary with 2**20+ decoder weights: PaddedLinear's case


def _bert_config():
    from transformers import BertConfig

    return BertConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=2,
                      intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=0.0,
                      attention_probs_dropout_prob=0.0, attn_implementation="sdpa")


class UserBert(L.LightningModule):
    """What a Lightning user writes: no mptrain module inside, training_step calls self.model(...)."""

    def __init__(self):
        super().__init__()
        from transformers import BertForMaskedLM

        self.model = BertForMaskedLM(_bert_config())
        self.losses: list = []

    def training_step(self, batch, batch_idx):
        loss = self.model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
        self.losses.append(loss.detach())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class UserResNet(L.LightningModule):
    def __init__(self):
        super().__init__()
        import torchvision

        self.model = torchvision.models.resnet18(num_classes=10)
        self.losses: list = []

    def training_step(self, batch, batch_idx):
        loss = F.cross_entropy(self.model(batch[0]), batch[1])
        self.losses.append(loss.detach())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def _mlm_batches(n=4, batch=2, seq=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(5, VOCAB, (batch, seq), generator=g)
        picked = torch.rand(batch, seq, generator=g) < 0.3
        out.append({"input_ids": ids, "labels": torch.where(picked, ids, torch.full_like(ids, -100))})
    return out


def _image_batches(n=3, batch=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 3, 16, 16, generator=g), torch.randint(0, 10, (batch,), generator=g))
            for _ in range(n)]


def _loader(batches):
    return torch.utils.data.DataLoader(batches, batch_size=None)  # each item is a batch


def _trainer_stub(plugin=None, device="cpu", callbacks=()):
    """What FuseModules.setup reads of a trainer."""
    return SimpleNamespace(precision_plugin=plugin or MasterPrecision("bf16-master"), callbacks=list(callbacks),
                           strategy=SimpleNamespace(root_device=torch.device(device)))


def _setup(module, mode=True, **stub):
    cb = FuseModules(mode)
    cb.setup(_trainer_stub(**stub), module, "fit")
    return cb


def test_user_bert_gets_fused_layer_norms_and_the_padded_decoder(caplog):
    torch.manual_seed(0)
    module = UserBert().eval()
    batch = _mlm_batches(1)[0]
    keys, params = list(module.state_dict()), dict(module.named_parameters())
    with torch.no_grad():
        before = module.model(**batch)
    with caplog.at_level(logging.INFO):
        cb = _setup(module)
    names = {s.name: s.new for s in cb.swapped}
    assert sum(new == "FusedLayerNorm" for new in names.values()) == 1 + 2 * 2 + 1  # embeddings, 2 per layer, head
    assert names["model.cls.predictions.decoder"] == "PaddedLinear" and len(names) == 7
    assert type(module.model.bert.encoder.layer[1].output.LayerNorm) is FusedLayerNorm
    assert type(module.model.cls.predictions.decoder) is PaddedLinear
    assert list(module.state_dict()) == keys
    assert all(p is params[n] for n, p in module.named_parameters())  # an optimizer's state stays attached
    assert module.model.cls.predictions.decoder.weight is module.model.bert.embeddings.word_embeddings.weight  # tied
    with torch.no_grad():
        after = module.model(**batch)
    assert torch.equal(after.logits, before.logits) and torch.equal(after.loss, before.loss)  # fp32 CPU: torch's ops
    line = [r.getMessage() for r in caplog.records if "fused modules" in r.getMessage()]
    assert line == ["mptrain: fused modules: 6 LayerNorm -> FusedLayerNorm (model...), "
                    "1 Linear -> PaddedLinear (model.cls.predictions.decoder)"]


@pytest.mark.parametrize("channels_last", [False, True])
def test_user_resnet_gets_the_fused_pool_same_output_and_grads(channels_last):
    torch.manual_seed(0)
    module = UserResNet()
    x, y = _image_batches(1)[0]
    if channels_last:
        module, x = module.to(memory_format=torch.channels_last), x.contiguous(memory_format=torch.channels_last)
    keys = list(module.state_dict())

    def loss_and_grads():
        module.zero_grad()
        loss = module.training_step((x, y), 0)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in module.parameters()]

    ref = loss_and_grads()
    cb = _setup(module)
    assert [(s.name, s.old, s.new) for s in cb.swapped] == [("model.maxpool", "MaxPool2d", "FusedMaxPool2d")]
    assert type(module.model.maxpool) is FusedMaxPool2d and list(module.state_dict()) == keys
    out = loss_and_grads()
    assert torch.equal(out[0], ref[0]) and all(torch.equal(a, b) for a, b in zip(out[1], ref[1]))


def test_swapped_modules_keep_their_hooks_and_a_user_subclass_is_left_alone():
    class MyNorm(nn.LayerNorm):
        pass

    class Net(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.encoder = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))  # not called "model"
            self.mine = MyNorm(8)

    net, seen = Net(), []
    net.encoder[1].register_forward_hook(lambda m, a, out: seen.append(type(m).__name__))
    _setup(net)
    assert type(net.encoder[1]) is FusedLayerNorm and type(net.mine) is MyNorm
    net.encoder(torch.randn(2, 8))
    assert seen == ["FusedLayerNorm"]


def test_auto_is_on_only_where_mptrain_kernels_run(monkeypatch):
    from mptrain import ops

    monkeypatch.setattr(ops, "get_extension", lambda required=False: object())  # as if the extension loaded
    cases = {  # (plugin, device) -> why "auto" is off (None: on)
        ("bf16-master", "cuda"): None, ("fp8-master", "cuda"): None, ("16-mixed", "cuda"): None,
        ("bf16-true", "cuda"): None, ("bf16-master", "cpu"): "the run trains on cpu",
        ("32-true", "cuda"): "precision '32-true'",
    }
    for (precision, device), why in cases.items():
        plugin = precision_plugin(precision)
        cb = FuseModules("auto")
        off = cb._why_off(_trainer_stub(plugin, device))
        assert (off is None) if why is None else why in off, (precision, device, off)
    assert FuseModules("auto")._why_off(_trainer_stub(MasterPrecision("bf16-master", fused=False), "cuda")) == \
        "fused=False"
    assert FuseModules("auto")._why_off(_trainer_stub(LightningMixed("bf16-mixed", "cuda"), "cuda")) is None
    monkeypatch.setattr(ops, "get_extension", lambda required=False: None)
    assert "extension is unavailable" in FuseModules("auto")._why_off(_trainer_stub(device="cuda"))


def test_auto_leaves_a_cpu_run_alone_and_false_adds_no_callback():
    module = UserResNet()
    module.model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(4 * 7 * 7, 10))
    trainer = quiet_trainer(precision="bf16-master", max_steps=1, enable_model_summary=False)
    trainer.fit(module, _loader(_image_batches(1)))
    assert type(module.model[1]) is nn.MaxPool2d
    assert next(c for c in trainer.callbacks if isinstance(c, FuseModules)).off_reason.startswith("the run trains on")
    assert not any(isinstance(c, FuseModules) for c in quiet_trainer(fuse_modules=False).callbacks)


@pytest.mark.parametrize("precision", ["32-true", "bf16-master", "bf16-mixed"])
def test_a_cpu_run_trains_bitwise_as_without_fused_modules(precision):
    """fuse_modules=True on the CPU: the modules run torch's own ops there, so losses and weights are unchanged."""
    runs = []
    for fuse in (False, True):
        torch.manual_seed(0)
        module = UserBert()
        trainer = quiet_trainer(precision=precision, fuse_modules=fuse, max_steps=3, enable_model_summary=False)
        trainer.fit(module, _loader(_mlm_batches(3)))
        assert (type(module.model.cls.predictions.decoder) is PaddedLinear) == fuse
        runs.append((torch.stack(module.losses), module.state_dict()))
    (l0, w0), (l1, w1) = runs
    assert torch.equal(l0, l1)
    assert list(w0) == list(w1) and all(torch.equal(w0[k], w1[k]) for k in w0)


def test_idempotent_with_a_recipe_model_that_fused_itself(caplog):
    from mptrain.models.bert import BertMLM

    module = BertMLM(vocab_size=VOCAB, hidden_size=HIDDEN, num_layers=1, num_heads=2, intermediate_size=64)
    before = {n: m for n, m in module.named_modules()}
    with caplog.at_level(logging.INFO):
        cb = _setup(module)
        _setup(module)
    assert cb.swapped == [] and {n: m for n, m in module.named_modules()} == before
    assert all(type(m) is not nn.LayerNorm for m in module.modules())
    lines = [r.getMessage() for r in caplog.records if "fused modules" in r.getMessage()]
    assert lines[0] == "mptrain: fused modules: none swapped (the model's own: 4 FusedLayerNorm, 1 PaddedLinear)"


@pytest.mark.parametrize("how", ["compile=True", "user"])
def test_under_compile_norms_are_left_to_inductor(caplog, how):
    class Net(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.LayerNorm(HIDDEN), nn.Linear(HIDDEN, VOCAB))
            self.head_norm = nn.LayerNorm(HIDDEN)  # outside `model`: runs eagerly

    net = Net()
    if how == "user":
        net.model.compile(backend="eager")  # Module.compile(): compiled in place, as compile=True does
    with caplog.at_level(logging.INFO):
        cb = _setup(net, callbacks=[CompileModel()] if how == "compile=True" else [])
    assert [(s.name, s.new) for s in cb.swapped] == [("model.2", "PaddedLinear"), ("head_norm", "FusedLayerNorm")]
    assert type(net.model[1]) is nn.LayerNorm
    assert "1 LayerNorm/RMSNorm left to torch.compile (model)" in caplog.text


def test_arguments_are_checked_before_any_setup():
    with pytest.raises(ValueError, match=r"fuse_modules='yes' is not valid; valid values: 'auto', True, False"):
        quiet_trainer(fuse_modules="yes")
    with pytest.raises(ValueError, match=r"fuse_modules=1 is not valid"):
        quiet_trainer(fuse_modules=1)
    with pytest.raises(ValueError, match=r"fuse_modules=True .* fused=False runs PyTorch only"):
        quiet_trainer(fuse_modules=True, fused=False)
    with pytest.raises(ValueError, match=r"fuse_modules=True .* has fused=False"):
        _setup(UserResNet(), plugin=MasterPrecision("bf16-master", fused=False))


def test_plain_lightning_trainer_takes_the_callback():
    """lightning.Trainer with mptrain's plugin and callbacks=[FuseModules(True)]: the same swap at setup."""
    module = UserResNet()
    module.model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(4 * 7 * 7, 10))
    trainer = L.Trainer(plugins=[MasterPrecision("bf16-master")], callbacks=[FuseModules(True)], accelerator="cpu",
                        devices=1, max_steps=2, logger=False, enable_progress_bar=False, enable_checkpointing=False,
                        enable_model_summary=False)
    trainer.fit(module, _loader(_image_batches(2)))
    assert type(module.model[1]) is FusedMaxPool2d and trainer.global_step == 2
