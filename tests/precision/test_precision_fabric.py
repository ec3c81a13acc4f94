"""The same plugin objects in lightning.Fabric with a hand-written loop."""
from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.nn.functional as F

from _models import classification_data, mlp
from mptrain.precision import MasterPrecision, precision_plugin


def _fabric_run(plugin, steps=6, nan_at=(), clip=None, accumulate=1):
    torch.manual_seed(0)
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    model = mlp()
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, opt = fabric.setup(model, opt)
    loader = fabric.setup_dataloaders(torch.utils.data.DataLoader(classification_data(n=32 * steps * accumulate),
                                                                  batch_size=32))
    snapshots = []
    it = iter(loader)
    for step in range(steps):
        snapshots.append([p.detach().clone() for p in model.parameters()])
        for micro in range(accumulate):
            x, y = next(it)
            with fabric.autocast():
                loss = F.cross_entropy(model(x), y)
            if step in nan_at and micro == 0:  # only the window's first micro-batch
                loss = loss * float("nan")
            fabric.backward(loss / accumulate)
        if clip is not None:
            fabric.clip_gradients(model, opt, max_norm=clip)
        opt.step()
        opt.zero_grad()
    snapshots.append([p.detach().clone() for p in model.parameters()])
    return fabric, model, opt, snapshots, init


@pytest.mark.parametrize("name", ["bf16-master", "16-master", "bf16-mixed", "16-mixed", "32-true", "bf16-true"])
def test_fabric_loop_trains_and_skips_a_nan_step(name):
    plugin = precision_plugin(name, loss_scaler={"init_scale": 256.0} if name.startswith("16-") else None)
    fabric, model, opt, snaps, _ = _fabric_run(plugin, nan_at={2}, clip=1.0)
    same = [all(torch.equal(a, b) for a, b in zip(snaps[k], snaps[k + 1])) for k in range(6)]
    assert same == [False, False, True, False, False, False]
    assert plugin.skipped_steps == 1
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_fabric_master_weights_match_the_lightning_semantics():
    plugin = MasterPrecision("bf16-master")
    fabric, model, opt, snaps, init = _fabric_run(plugin, steps=1)
    inner = model.module
    assert inner[0].weight.dtype == torch.bfloat16 and inner[1].weight.dtype == torch.float32
    masters = [p for g in opt.param_groups for p in g["params"]]
    assert all(m.dtype == torch.float32 for m in masters)
    # the master started from the fp32 init: step 1 of SGD from it, not from its bf16 copy
    w = inner[0].weight
    assert torch.equal(w, plugin.master_for(w).to(torch.bfloat16))


def test_fabric_save_and_load_hold_fp32_masters(tmp_path):
    plugin = MasterPrecision("bf16-master")
    fabric, model, opt, _, _ = _fabric_run(plugin, steps=3)
    path = tmp_path / "fabric.ckpt"
    fabric.save(path, {"model": model, "optimizer": opt})
    saved = torch.load(path, weights_only=True)["model"]
    inner = model.module
    for n, p in inner.named_parameters():
        assert saved[n].dtype == torch.float32
        master = plugin.master_for(p)
        assert torch.equal(saved[n], master if master is not None else p.detach())
    # loading writes the fp32 values into the masters bitwise (not their bf16 copy)
    with torch.no_grad():
        for m in (plugin.master_for(p) for p in inner.parameters()):
            if m is not None:
                m.add_(1.0)
    fabric.load(path, {"model": model, "optimizer": opt})
    for n, p in inner.named_parameters():
        master = plugin.master_for(p)
        if master is not None:
            assert torch.equal(master, saved[n]) and torch.equal(p.detach(), saved[n].to(p.dtype))


def test_fabric_accumulation_window_is_skipped_whole():
    plugin = MasterPrecision("bf16-master")
    _, _, _, snaps, _ = _fabric_run(plugin, steps=3, nan_at={1}, accumulate=2)
    assert all(torch.equal(a, b) for a, b in zip(snaps[1], snaps[2]))
    assert plugin.skipped_steps == 1


def test_fabric_switch_to_fp32_takes_fabrics_wrappers():
    plugin = MasterPrecision("bf16-master")
    fabric, model, opt, _, _ = _fabric_run(plugin, steps=2)
    masters = {n: plugin.master_for(p).clone() for n, p in model.module.named_parameters()
               if plugin.master_for(p) is not None}
    plugin.switch_to_fp32(model, [opt])
    assert plugin.precision == "32-true" and plugin.phase == "fp32"
    for n, p in model.module.named_parameters():
        assert p.dtype == torch.float32
        if n in masters:
            assert torch.equal(p.detach(), masters[n])
    assert [p for g in opt.param_groups for p in g["params"]] == list(model.module.parameters())
    x, y = classification_data(n=8)[:]
    fabric.backward(F.cross_entropy(model(x), y))
    opt.step()
