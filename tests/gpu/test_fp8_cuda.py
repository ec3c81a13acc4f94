"""fp8-master on an fp8 GPU: the linears run torchao's float8 GEMMs (tensorwise and rowwise) under
mptrain.Trainer, eager and compiled, with torch's and mptrain's optimizers, CUDA graphs, and the fp32
fine-tune switch; the result tracks a bf16-master run of the same model and data."""
import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytest.importorskip("torchao")

import mptrain  # noqa: E402
from mptrain.optim import FusedAdamW  # noqa: E402

from _models import quiet_trainer  # noqa: E402

fp8_gpu = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                             reason="needs fp8 tensor cores (compute capability >= 8.9)")
pytestmark = fp8_gpu

D, TOKENS, CLASSES = 1024, 4096, 16


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(64, D)
        self.layers = nn.ModuleList(nn.Sequential(nn.LayerNorm(D), nn.Linear(D, 4 * D), nn.GELU(),
                                                  nn.Linear(4 * D, D)) for _ in range(2))
        self.head = nn.Linear(D, CLASSES)

    def forward(self, x):
        h = self.embed(x)
        for layer in self.layers:
            h = h + layer(h)
        return self.head(h)


class Module(L.LightningModule):
    def __init__(self, optimizer="adamw"):
        super().__init__()
        torch.manual_seed(0)
        self.model = Net()
        self.optimizer = optimizer
        self.losses = []

    def training_step(self, batch, _):
        x, y = batch
        loss = F.cross_entropy(self.model(x), y)
        self.losses.append(loss.detach().float())
        return loss

    def configure_optimizers(self):
        if self.optimizer == "fused":
            return FusedAdamW(self.parameters(), lr=1e-3)
        return torch.optim.AdamW(self.parameters(), lr=1e-3, fused=True, capturable=True)


def _loader(steps):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(TOKENS, 64, generator=g)
    w = torch.randn(64, CLASSES, generator=g)
    y = (x @ w).argmax(1)
    data = torch.utils.data.TensorDataset(x, y)
    return torch.utils.data.DataLoader(data, batch_size=TOKENS // 4, shuffle=False, drop_last=True)


def _fit(precision_or_plugin, steps=24, **kw):
    model = Module(kw.pop("optimizer", "adamw"))
    plugin = precision_or_plugin if not isinstance(precision_or_plugin, str) else None
    args = dict(plugins=[plugin]) if plugin is not None else dict(precision=precision_or_plugin)
    trainer = quiet_trainer(accelerator="cuda", max_steps=steps, **args, **kw)
    trainer.fit(model, _loader(steps))
    return model, trainer


def _fp8_names(model):
    from mptrain.precision.fp8 import is_float8_linear

    return [n for n, m in model.named_modules() if is_float8_linear(m)]


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "delayed"])
@pytest.mark.parametrize("compile", [False, True])
def test_fp8_master_trains_like_bf16_master(recipe, compile):
    ref, _ = _fit("bf16-master", compile=compile)
    plugin = mptrain.Fp8Precision(recipe=recipe)
    model, trainer = _fit(plugin, compile=compile)
    assert _fp8_names(model) == ["model.layers.0.1", "model.layers.0.3", "model.layers.1.1", "model.layers.1.3"]
    assert plugin.fp8_layers == _fp8_names(model)
    assert set(plugin.kept_layers) == {"model.embed", "model.head"}
    losses, ref_losses = torch.stack(model.losses).float(), torch.stack(ref.losses).float()
    assert torch.isfinite(losses).all()
    assert losses[-4:].mean() < 0.5 * losses[:4].mean()
    assert abs(losses[-4:].mean() - ref_losses[-4:].mean()) < 0.1 * ref_losses[-4:].mean() + 0.02
    assert trainer.skipped_steps == 0


def test_fp8_master_with_fused_adamw_and_cuda_graphs():
    model, trainer = _fit("fp8-master", optimizer="fused", cuda_graphs=True)
    cb = next(c for c in trainer.callbacks if isinstance(c, mptrain.CudaGraphs))
    assert cb.replayed_steps > 0
    assert len(_fp8_names(model)) == 4
    losses = torch.stack(model.losses).float()
    assert torch.isfinite(losses).all() and losses[-4:].mean() < losses[:4].mean()


def test_fp32_finetune_leaves_no_fp8_layer():
    model, trainer = _fit("fp8-master", steps=-1, max_epochs=2, fp32_finetune_epochs=1)
    assert trainer.precision_plugin.precision == "32-true"
    assert _fp8_names(model) == []
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_fp8_output_matches_bf16_within_fp8_rounding():
    torch.manual_seed(0)
    net, ref = Net().cuda(), Net().cuda()
    ref.load_state_dict(net.state_dict())
    plugin = mptrain.Fp8Precision(keep_bf16=[])
    plugin.convert_module(net)
    x = torch.randn(2048, 64, device="cuda")
    with plugin.forward_context():
        y = net(plugin.convert_input(x)).float()
    err = ((y - ref(x)).norm() / ref(x).norm()).item()
    assert 1e-4 < err < 0.08, err


def test_the_fp8_swiglu_kernels_match_their_references_on_cuda():
    from mptrain.precision.fp8_swiglu import (fp8_swiglu, fp8_swiglu_backward, swiglu_backward_reference,
                                              swiglu_reference, triton_kernels)

    assert triton_kernels() is not None
    torch.manual_seed(0)
    m, n = 4096 + 96, 2048 + 160  # neither a multiple of the 64 x 64 tile
    g, u, dh = (torch.randn(m, n, device="cuda", dtype=torch.bfloat16) * 3 for _ in range(3))
    s, sg, su = (torch.tensor(v, device="cuda") for v in (50.0, 1000.0, 2000.0))
    pairs = [(fp8_swiglu(g, u, s), swiglu_reference(g, u, s)),
             (fp8_swiglu_backward(dh, g, u, sg, su), swiglu_backward_reference(dh, g, u, sg, su))]
    for got, want in pairs:
        for a, b in zip(got, want):
            assert a.shape == b.shape and a.dtype == b.dtype and a.is_contiguous()
            if a.dim() == 0:
                torch.testing.assert_close(a, b, rtol=1e-5, atol=0)
                continue
            a, b = a.float(), b.float()
            differ = a != b  # the SiLU's fp32 arithmetic, Triton's against torch's: a rounding tie now and then
            assert differ.float().mean() < 1e-3
            torch.testing.assert_close(a[differ], b[differ], rtol=0.25, atol=0)


@pytest.mark.parametrize("compile", [False, True])
def test_a_llama_trains_with_fused_mlps_like_unfused_layers(compile):
    """The delayed recipe fuses the Llama's MLPs; its losses track the same run with the MLPs left unfused."""
    transformers = pytest.importorskip("transformers")

    from _models import CausalLM

    cfg = transformers.LlamaConfig(hidden_size=512, intermediate_size=1536, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=4, vocab_size=512)
    # counting sequences from random starts: learnable within the run's 20 steps
    starts = torch.randint(0, 512, (160, 1), generator=torch.Generator().manual_seed(0))
    ids = (starts + torch.arange(256)) % 512
    runs = {}
    for fuse in (True, False):
        lm = CausalLM(cfg)
        plugin = mptrain.Fp8Precision(recipe="delayed", keep_bf16=["-<small>"], fuse_mlps=fuse)
        quiet_trainer(plugins=[plugin], max_steps=20, accelerator="gpu", devices=1, compile=compile).fit(
            lm, torch.utils.data.DataLoader(ids, batch_size=8))
        assert len(plugin.fused_mlps) == (2 if fuse else 0)
        runs[fuse] = torch.stack(lm.losses).cpu()
    assert torch.isfinite(runs[True]).all()
    assert runs[True][-5:].mean() < 0.8 * runs[True][:3].mean()
    # the fused MLP casts the SwiGLU from fp32, the unfused eager layers from bf16: fp8 roundings apart
    torch.testing.assert_close(runs[True], runs[False], rtol=0.05, atol=0)
