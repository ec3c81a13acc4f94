"""Model builders and LightningModules: shapes, losses, optimizer groups, schedules, metrics."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from mptrain.models import BertMLM, ImageClassifier, LSTMLanguageModel, build_image_model
from mptrain.models.optim import decay_groups
from mptrain.models.schedules import warmup_cosine, warmup_linear


class Logged:
    """Stands in for the trainer side of self.log: records what the module logs."""

    def __init__(self, module):
        self.values = {}
        module.log = lambda name, value, **kw: self.values.__setitem__(name, float(value))
        module.log_dict = lambda d, **kw: self.values.update({k: float(v) for k, v in d.items()})


def test_digits_cnn_and_torchvision_resnet():
    assert build_image_model("digits_cnn", 10)(torch.rand(2, 1, 8, 8)).shape == (2, 10)
    pytest.importorskip("torchvision")
    net = build_image_model("resnet50", 7)
    assert sum(p.numel() for p in net.parameters()) > 23e6
    with pytest.raises(ValueError, match="resnet50"):
        build_image_model("resnet51", 10)


def test_classifier_loss_label_smoothing_and_topk_metrics():
    torch.manual_seed(0)
    m = ImageClassifier(arch="digits_cnn", num_classes=10, label_smoothing=0.1).eval()  # no dropout noise
    x, y = torch.rand(16, 1, 8, 8), torch.randint(0, 10, (16,))
    loss = m.training_step((x, y), 0)
    assert torch.allclose(loss, F.cross_entropy(m(x), y, label_smoothing=0.1))
    log = Logged(m)
    with torch.no_grad():
        m.validation_step((x, y), 0)
        logits = m(x)
    assert log.values["val/acc"] == pytest.approx((logits.argmax(1) == y).float().mean().item())
    top5 = (logits.topk(5, dim=1).indices == y[:, None]).any(1).float().mean().item()
    assert log.values["val/acc_top5"] == pytest.approx(top5)


def test_optimizer_groups_skip_decay_on_norms_and_biases():
    m = ImageClassifier(arch="digits_cnn", optimizer="sgd", weight_decay=0.1, warmup_steps=3, total_steps=10)
    conf = m.configure_optimizers()
    opt = conf["optimizer"]
    assert isinstance(opt, torch.optim.SGD) and opt.defaults["momentum"] == 0.9
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() > 1 for p in decay["params"]) and all(p.dim() == 1 for p in no_decay["params"])
    assert conf["lr_scheduler"]["interval"] == "step"


def test_decay_groups_list_tied_weights_once():
    emb = torch.nn.Embedding(10, 4)
    head = torch.nn.Linear(4, 10)
    head.weight = emb.weight
    groups = decay_groups(torch.nn.ModuleList([emb, head]), 0.01)
    ids = [id(p) for g in groups for p in g["params"]]
    assert len(ids) == len(set(ids)) == 2


def _lrs(make, steps):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = make(opt)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def test_warmup_cosine_and_linear_shapes():
    cos = _lrs(lambda o: warmup_cosine(o, 4, lambda: 20, min_ratio=0.1), 21)
    assert cos[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert cos[4] == pytest.approx(1.0) and cos[12] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert cos[20] == pytest.approx(0.1)
    lin = _lrs(lambda o: warmup_linear(o, 2, lambda: 10), 11)
    assert lin[:2] == pytest.approx([0.5, 1.0]) and lin[6] == pytest.approx(0.5) and lin[10] == pytest.approx(0.0)


def test_schedule_reads_the_run_length_when_the_trainer_knows_it():
    m = ImageClassifier(arch="digits_cnn", warmup_steps=0)
    total = {"n": 0}

    class Shim:
        @property
        def estimated_stepping_batches(self):
            return total["n"]

    type(m).trainer = property(lambda self: Shim())  # what an attached Trainer exposes
    try:
        sched = m.configure_optimizers()["lr_scheduler"]["scheduler"]
        total["n"] = 4  # known only after configure_optimizers, as in the Trainer
        lrs = []
        for _ in range(5):
            lrs.append(sched.get_last_lr()[0])
            sched.optimizer.step()
            sched.step()
        assert lrs[-1] == pytest.approx(0.0, abs=1e-9) and lrs[2] == pytest.approx(0.05)
    finally:
        del type(m).trainer


def tiny_bert(**kw):
    pytest.importorskip("transformers")
    return BertMLM(vocab_size=60, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64,
                   max_position_embeddings=32, dropout=0.0, **kw)


def test_bert_needs_a_vocab():
    with pytest.raises(ValueError, match="vocab_size"):
        BertMLM()


@pytest.mark.parametrize("max_predictions", [None, 6])
def test_bert_sparse_head_matches_full_mlm_loss(max_predictions):
    torch.manual_seed(0)
    m = tiny_bert(fused_layernorm=False, max_predictions=max_predictions).eval()
    ids = torch.randint(5, 60, (3, 16))
    labels = torch.full_like(ids, -100)
    labels[:, 3:7] = ids[:, 3:7]
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
    with torch.no_grad():
        ours = m.training_step(batch, 0)
        # transformers' own BertForMaskedLM with our weights (the keys match): the loss over all positions
        from transformers import BertForMaskedLM

        ref = BertForMaskedLM(m.model.bert.config).eval()
        ref.load_state_dict(m.model.state_dict())
        full = ref(input_ids=ids, labels=labels).loss
    assert ours.item() == pytest.approx(full.item(), rel=1e-5)
    log = Logged(m)
    with torch.no_grad():
        m.validation_step(batch, 0)
        m.on_validation_epoch_end()
    assert log.values["val/loss"] == pytest.approx(full.item(), rel=1e-5)
    assert 0 <= log.values["val/mlm_acc"] <= 1
    assert log.values["val/perplexity"] == pytest.approx(math.exp(full.item()), rel=1e-4)


def test_bert_max_predictions_caps_the_predicted_tokens():
    torch.manual_seed(0)
    m = tiny_bert(fused_layernorm=False, max_predictions=2).eval()
    ids = torch.randint(5, 60, (2, 16))
    labels = torch.full_like(ids, -100)
    labels[:, 3:7] = ids[:, 3:7]
    _, logits, target, count = m({"input_ids": ids, "labels": labels})
    assert logits.shape[0] == 4 and int(count) == 4 and (target != -100).all()


def test_bert_layernorms_are_fused_when_mptrain_nn_is_there():
    m = tiny_bert(fused_layernorm=True)
    kinds = {type(mod).__name__ for mod in m.modules() if "Norm" in type(mod).__name__}
    try:
        import mptrain.nn  # noqa: F401
    except ImportError:
        assert kinds == {"LayerNorm"}
    else:
        assert "LayerNorm" not in kinds, kinds


def test_bert_adamw_linear_schedule():
    m = tiny_bert(lr=1e-3, warmup_steps=2, total_steps=4)
    conf = m.configure_optimizers()
    assert isinstance(conf["optimizer"], torch.optim.AdamW)
    assert conf["optimizer"].param_groups[1]["weight_decay"] == 0.0


def test_lstm_lm_loss_perplexity_and_tied_weights():
    torch.manual_seed(0)
    m = LSTMLanguageModel(vocab_size=40, embedding_dim=16, hidden_size=24, num_layers=2, dropout=0.0)
    assert m.model.head.weight is m.model.embed.weight
    assert isinstance(m.model.rnn, torch.nn.LSTM)  # FusedLSTM subclasses it
    x = torch.randint(0, 40, (3, 10))
    y = torch.randint(0, 40, (3, 10))
    loss = m.training_step((x, y), 0)
    assert abs(loss.item() - math.log(40)) < 0.5
    loss.backward()
    assert m.model.embed.weight.grad is not None
    log = Logged(m)
    with torch.no_grad():
        m.eval().validation_step((x, y), 0)
        m.on_validation_epoch_end()
    assert log.values["val/perplexity"] == pytest.approx(math.exp(log.values["val/loss"]), rel=1e-4)


def test_lstm_uses_fused_lstm_when_available():
    m = LSTMLanguageModel(vocab_size=10, embedding_dim=8, hidden_size=8, num_layers=1, dropout=0.0)
    try:
        from mptrain.nn import FusedLSTM
    except ImportError:
        pytest.skip("mptrain.nn.FusedLSTM not available")
    assert isinstance(m.model.rnn, FusedLSTM)


PLAIN_LIGHTNING = {
    "classifier": (lambda: ImageClassifier(arch="digits_cnn", optimizer="adamw", lr=1e-3),
                   lambda: __import__("mptrain.data", fromlist=["x"]).DigitsDataModule(batch_size=8, synthetic=True,
                                                                                       synthetic_batches=2)),
    "lstm": (lambda: LSTMLanguageModel(vocab_size=50, embedding_dim=8, hidden_size=8, num_layers=1, fused=False),
             lambda: __import__("mptrain.data", fromlist=["x"]).LMTextDataModule(batch_size=2, seq_len=6, vocab_size=50,
                                                                               synthetic=True, synthetic_batches=2)),
}


@pytest.mark.parametrize("name", list(PLAIN_LIGHTNING))
def test_models_train_under_plain_lightning(name, tmp_path):
    """The recipe modules are plain Lightning: lightning.Trainer runs them as they are."""
    import lightning as L

    make_model, make_data = PLAIN_LIGHTNING[name]
    trainer = L.Trainer(accelerator="cpu", max_steps=2, limit_val_batches=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(make_model(), datamodule=make_data())
    assert trainer.global_step == 2 and torch.isfinite(trainer.callback_metrics["train/loss"])


@pytest.mark.parametrize("kwargs, match", [({"lr": -1.0}, "model.lr=-1.0"), ({"weight_decay": -0.1}, "weight_decay"),
                                           ({"label_smoothing": 1.0}, "label_smoothing"),
                                           ({"arch": "digits_cnnn"}, "digits_cnnn")])
def test_bad_hyperparameters_fail_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ImageClassifier(**kwargs)


def _compile_fullgraph_matches_eager(m):
    """``m.model`` compiled fullgraph on a masked batch: its output (checked against eager) and the graphs."""
    ids = torch.randint(5, 60, (3, 16))
    labels = torch.full_like(ids, -100)
    labels[:, 3:7] = ids[:, 3:7]
    eager = m.model(ids, labels)
    torch._dynamo.reset()
    graphs = []
    out = torch.compile(m.model, backend=lambda gm, ex: graphs.append(gm) or gm.forward, fullgraph=True)(ids, labels)
    torch.testing.assert_close(out[0], eager[0])
    return out, graphs


def test_bert_compiled_model_is_the_whole_network_in_one_graph():
    """compile=True compiles ``BertMLM.model``: its forward must be the encoder, the gather and the
    head, with no mask built in the graph (an all-true mask sends SDPA to the fp32 math path)."""
    torch.manual_seed(0)
    m = tiny_bert(fused_layernorm=False, max_predictions=4)
    out, graphs = _compile_fullgraph_matches_eager(m)
    assert len(graphs) == 1
    code = graphs[0].code
    assert "scaled_dot_product_attention" in code and "topk" in code and "cross_entropy" in code
    sdpa = [line for line in code.splitlines() if "scaled_dot_product_attention(" in line]
    assert len(sdpa) == 2 and all("attn_mask = None" in line for line in sdpa), sdpa


def test_bert_recipe_network_with_fused_layernorm_and_softmax_compiles_in_one_graph():
    """The recipe's network with mptrain's fused LayerNorm and masked-softmax attention: one
    fullgraph holding the mptrain ops, no graph break."""
    from mptrain.nn.attention import ATTENTION_NAME

    torch.manual_seed(0)
    m = tiny_bert(fused_layernorm=True, max_predictions=4, attn_implementation=ATTENTION_NAME)
    out, graphs = _compile_fullgraph_matches_eager(m)
    out[0].backward()
    assert len(graphs) == 1
    assert "mptrain.layer_norm" in graphs[0].code and "mptrain.scaled_masked_softmax" in graphs[0].code


def test_bert_without_padding_gives_sdpa_no_mask_even_while_a_cuda_graph_captures(monkeypatch):
    """transformers builds an all-true mask when it cannot look at tensors (capture, tracing); with a
    mask SDPA leaves its fused kernels for the fp32 math path (cuda_graphs=True ran 0.7x eager)."""
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    masks = []
    sdpa = F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, *args, **kwargs):
        masks.append(attn_mask)
        return sdpa(q, k, v, attn_mask, *args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    m = tiny_bert(max_predictions=4)
    ids = torch.randint(5, 60, (2, 16))
    m({"input_ids": ids, "labels": ids, "attention_mask": torch.ones_like(ids)})
    assert len(masks) == 2 and all(mask is None for mask in masks)
    m.hparams.use_attention_mask = True  # padding: the mask is passed on
    masks.clear()
    m({"input_ids": ids, "labels": ids, "attention_mask": torch.ones_like(ids)})
    assert len(masks) == 2 and all(mask is not None for mask in masks)


def test_fused_image_model_keeps_parameters_and_results():
    from torch import nn

    from mptrain.models.vision import ChannelPaddedConv2d
    from mptrain.nn import FusedMaxPool2d

    torch.manual_seed(0)
    fused, stock = ImageClassifier("resnet18", num_classes=5), ImageClassifier("resnet18", num_classes=5, fused=False)
    assert type(fused.model.conv1) is ChannelPaddedConv2d and type(fused.model.maxpool) is FusedMaxPool2d
    assert type(stock.model.conv1) is nn.Conv2d and type(stock.model.maxpool) is nn.MaxPool2d
    stock.load_state_dict(fused.state_dict())  # the same keys and shapes
    x = torch.randn(2, 3, 32, 32)
    fused.eval(), stock.eval()
    assert torch.equal(fused(x), stock(x))


def test_channel_padded_conv_pads_only_where_it_pays_and_changes_nothing(monkeypatch):
    from torch import nn

    from mptrain.models.vision import ChannelPaddedConv2d

    torch.manual_seed(0)
    conv = nn.Conv2d(3, 8, 7, 2, 3, bias=False)
    ref = nn.Conv2d(3, 8, 7, 2, 3, bias=False)
    ref.load_state_dict(conv.state_dict())
    padded = ChannelPaddedConv2d.from_conv(conv)
    assert padded is conv and not padded.pads(torch.randn(1, 3, 8, 8))  # fp32 on the CPU: as it is
    monkeypatch.setattr(ChannelPaddedConv2d, "pads", lambda self, x: True)
    x = torch.randn(2, 3, 16, 16, dtype=torch.float64)
    padded.double(), ref.double()
    y, r = padded(x), ref(x)
    torch.testing.assert_close(y, r, rtol=1e-12, atol=1e-12)
    g = torch.randn_like(r)
    torch.testing.assert_close(torch.autograd.grad(y, padded.weight, g)[0], torch.autograd.grad(r, ref.weight, g)[0],
                               rtol=1e-12, atol=1e-12)
    assert padded.weight.shape == (8, 3, 7, 7)
    with pytest.raises(TypeError, match="nn.Conv2d"):
        ChannelPaddedConv2d.from_conv(nn.Conv1d(3, 8, 3))
