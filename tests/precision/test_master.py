"""*-master: half params, fp32 masters from the fp32 init, exact against a hand-written fp32 reference."""
from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Callback

from _models import Classifier, classification_data, mlp
from _plain_lightning import loader, trainer
from mptrain.precision import MasterPrecision, MixedPrecision


class GrabGrads(Callback):
    """The unscaled (master) grads of every step, as the optimizer reads them."""

    def __init__(self):
        self.steps = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.steps.append({n: g.detach().clone() for n, g in trainer.precision_plugin.unscaled_grads().items()})


def _reference(init: dict, grads_per_step: list, make_opt) -> dict:
    ref = {n: torch.nn.Parameter(v.clone()) for n, v in init.items()}
    opt = make_opt(list(ref.values()))
    for grads in grads_per_step:
        for n, p in ref.items():
            p.grad = grads[n].float()
        opt.step()
    return ref


@pytest.mark.parametrize("name,half", [("bf16-master", torch.bfloat16), ("16-master", torch.float16)])
@pytest.mark.parametrize("opt", ["adamw", "sgd"])
def test_masters_match_fp32_reference(name, half, opt):
    torch.manual_seed(0)
    model = Classifier(mlp(), lr=1e-2 if opt == "adamw" else 0.1, optimizer=opt)
    init = {n: p.detach().clone() for n, p in model.named_parameters()}  # fp32, before any cast
    plugin = MasterPrecision(name, loss_scaler={"init_scale": 256.0} if name == "16-master" else None)
    grab = GrabGrads()
    trainer(plugin, max_steps=5, callbacks=[grab]).fit(model, loader(n=160))
    assert plugin.skipped_steps == 0 and len(grab.steps) == 5
    assert model.net[0].weight.dtype == half and model.net[1].weight.dtype == torch.float32
    make = (lambda ps: torch.optim.AdamW(ps, lr=1e-2)) if opt == "adamw" else \
        (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9))
    ref = _reference(init, grab.steps, make)
    for n, p in model.named_parameters():
        master = plugin.master_for(p)
        m = master if master is not None else p
        assert m.dtype == torch.float32
        torch.testing.assert_close(m.detach(), ref[n].detach(), rtol=0, atol=1e-6)
        if p.dtype == half:
            assert torch.equal(p.detach(), m.detach().to(half)), f"{n}: param != master cast down"


def test_masters_start_from_the_fp32_init_not_the_half_copy():
    torch.manual_seed(0)
    model = Classifier(mlp(), lr=0.0, optimizer="sgd")  # lr 0: the masters keep their initial values
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    plugin = MasterPrecision("bf16-master")
    trainer(plugin, max_steps=1).fit(model, loader())
    w = model.net[0].weight
    assert torch.equal(plugin.master_for(w), init["net.0.weight"])
    assert not torch.equal(w.float(), init["net.0.weight"])  # the half copy did lose bits


@pytest.mark.parametrize("name", ["bf16-master", "16-master"])
def test_mptrain_fused_adamw_takes_the_whole_step(name):
    """With mptrain's FusedAdamW the plugin hands over the step: the masters live in its state."""
    from mptrain.optim import FusedAdamW

    class M(Classifier):
        def configure_optimizers(self):
            return FusedAdamW(self.parameters(), lr=1e-2)

    torch.manual_seed(0)
    model = M(mlp())
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    plugin = MasterPrecision(name, loss_scaler={"init_scale": 256.0} if name == "16-master" else None)
    grab = GrabGrads()
    t = trainer(plugin, max_steps=5, callbacks=[grab])
    t.fit(model, loader(n=160))
    opt = t.optimizers[0]
    assert opt.master_weights and plugin.skipped_steps == 0
    ref = _reference(init, grab.steps, lambda ps: torch.optim.AdamW(ps, lr=1e-2))
    for n, p in model.named_parameters():
        master = opt.master_param(p)
        assert master.dtype == torch.float32
        # mptrain's Adam and torch's differ in operation order: close, not bitwise
        torch.testing.assert_close(master.detach(), ref[n].detach(), rtol=0, atol=1e-5)
        if p.dtype != torch.float32:
            assert torch.equal(p.detach(), master.detach().to(p.dtype))


@pytest.mark.parametrize("name", ["16-mixed", "bf16-mixed"])
def test_mptrain_fused_sgd_under_mixed_skips_on_device(name):
    from mptrain.optim import FusedSGD

    class M(Classifier):
        def configure_optimizers(self):
            return FusedSGD(self.parameters(), lr=0.1, momentum=0.9)

    torch.manual_seed(0)
    model = M(mlp(), inf_at_steps={1})
    before = {}

    class Snap(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            before[trainer.global_step] = [p.detach().clone() for p in pl_module.parameters()]

    plugin = MixedPrecision(name, loss_scaler={"init_scale": 256.0})
    trainer(plugin, max_steps=4, callbacks=[Snap()]).fit(model, loader(n=128))
    assert all(torch.equal(a, b) for a, b in zip(before[1], before[2]))  # step 1 (inf) changed nothing
    assert not all(torch.equal(a, b) for a, b in zip(before[2], before[3]))
    assert plugin.skipped_steps == 1


def test_norm_layers_compute_in_fp32_and_return_half():
    torch.manual_seed(0)
    model = Classifier(mlp())
    plugin = MasterPrecision("bf16-master")
    plugin.convert_module(model)
    x = plugin.convert_input(classification_data(n=8)[:][0])
    h = model.net[0](x)
    with plugin.forward_context():
        out = model.net[1](h)
    assert out.dtype == torch.bfloat16
    ref = torch.nn.functional.layer_norm(h.float(), (64,), model.net[1].weight, model.net[1].bias).bfloat16()
    assert torch.equal(out, ref)


def test_a_second_fit_keeps_the_masters():
    torch.manual_seed(0)
    model = Classifier(mlp())
    plugin = MasterPrecision("bf16-master")
    trainer(plugin, max_steps=2).fit(model, loader())
    w = model.net[0].weight
    first = plugin.master_for(w).clone()
    assert not torch.equal(first, first.bfloat16().float())
    model.lr = 0.0  # the second fit's optimizer changes nothing: its masters must be the first fit's
    trainer(plugin, max_steps=1).fit(model, loader())
    assert torch.equal(plugin.master_for(w), first)


class GradsAlive(Callback):
    """What each step leaves for the next forward: the fp32 init copies, and the grads (half and masters')."""

    def __init__(self):
        self.at_batch_start = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        plugin = trainer.precision_plugin
        masters = [p for g in trainer.optimizers[0].param_groups for p in g["params"]]
        self.at_batch_start.append({
            "fp32_init": len(plugin._fp32_init),
            "half grads": sum(p.grad is not None for p in pl_module.parameters() if p.dtype == torch.bfloat16),
            "master grads": sum(m.grad is not None for m in masters if plugin.master_for(m) is None
                                and m.dtype == torch.float32 and m.dim() > 1),
        })


def test_no_fp32_copy_outlives_the_step_that_consumed_it():
    """No fp32 init copy survives the masters' creation, and a step frees its fp32 grad set: the next forward
    runs beside the params, masters and optimizer state only (Lightning's zero_grad comes after that forward)."""
    torch.manual_seed(0)
    model = Classifier(mlp(), optimizer="adamw")
    plugin = MasterPrecision("bf16-master")
    alive = GradsAlive()
    trainer(plugin, max_steps=3, callbacks=[alive]).fit(model, loader())
    assert plugin._fp32_init == {}
    assert [a["fp32_init"] for a in alive.at_batch_start] == [0, 0, 0]
    assert [a["half grads"] + a["master grads"] for a in alive.at_batch_start] == [0, 0, 0]
    w = model.net[0].weight
    assert w.grad is None and plugin.master_for(w).grad is None  # after the last step too


def test_a_skipped_step_frees_its_grads_too():
    """A step skipped for inf grads consumes its window as well: nothing of it reaches the next one."""
    torch.manual_seed(0)
    model = Classifier(mlp(), optimizer="sgd", inf_at_steps={1})
    plugin = MasterPrecision("16-master", loss_scaler={"init_scale": 256.0})
    alive = GradsAlive()
    trainer(plugin, max_steps=3, callbacks=[alive]).fit(model, loader())
    assert plugin.skipped_steps == 1
    assert [a["half grads"] + a["master grads"] for a in alive.at_batch_start] == [0, 0, 0]
    w = model.net[0].weight
    assert w.grad is None and plugin.master_for(w).grad is None


def test_non_persistent_float_buffers_keep_their_dtype():
    """A derived constant (RoPE's inv_freq) stays fp32 under a master mode; persistent buffers are cast."""
    from torch import nn
    from mptrain.precision import MasterPrecision

    m = nn.Linear(4, 4)
    m.register_buffer("inv_freq", torch.rand(4), persistent=False)
    m.register_buffer("stat", torch.rand(4))
    MasterPrecision("bf16-master").convert_module(m)
    assert m.inv_freq.dtype == torch.float32 and m.stat.dtype == torch.bfloat16 and m.weight.dtype == torch.bfloat16
