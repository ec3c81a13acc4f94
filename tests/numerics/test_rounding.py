"""numerics.rounding.rounding_loss: the share of one step's updates bf16 round-to-nearest would lose, per parameter
group, against a direct bf16-true step; nothing of the model or optimizer changes; mptrain's optimizers (masters)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from mptrain.numerics.rounding import format_rounding_report, rounding_loss
from mptrain.optim import FusedAdamW


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.LayerNorm(64), nn.Linear(64, 4))


def _loss(model):
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(1))
    return lambda: model(x).square().mean()


@pytest.mark.parametrize("lr", [1e-2, 1e-4, 1e-6])
def test_lost_share_equals_a_direct_bf16_true_step(lr):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    rows = rounding_loss(model, opt, loss_fn=_loss(model))
    assert not opt.state and len(rows) == 1
    # the direct check: the fp32 step's update on a copy, added to the bf16 weight and rounded to nearest
    copy = [p.detach().clone().requires_grad_() for p in model.parameters()]
    for c, p in zip(copy, model.parameters()):
        c.grad = p.grad.clone()
    torch.optim.SGD(copy, lr=lr, momentum=0.9).step()
    lost = updated = 0
    for c, p in zip(copy, model.parameters()):
        u = c.detach() - p.detach()
        low = p.detach().bfloat16()
        moved = u != 0
        updated += int(moved.sum())
        lost += int((moved & ((low.float() + u).bfloat16() == low)).sum())
    r = rows[0]
    assert (r.updated, r.lost) == (updated, lost) and r.lr == lr
    assert r.lost_share == pytest.approx(lost / updated)


def test_groups_state_and_nothing_changes():
    model = _model()
    opt = torch.optim.AdamW([{"params": model[0].parameters()},
                             {"params": list(model[1].parameters()) + list(model[2].parameters()), "lr": 1e-7}],
                            lr=1e-2)
    _loss(model)().backward()
    opt.step()  # state exists: the copy steps from it
    opt.zero_grad()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    state = {k: v.clone() for k, v in opt.state[model[0].weight].items()}
    rows = rounding_loss(model, opt, loss_fn=_loss(model))
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert all(torch.equal(v, opt.state[model[0].weight][k]) for k, v in state.items())
    assert [r.group for r in rows] == [0, 1] and rows[1].lr == 1e-7
    assert rows[0].lost_share < 0.2 < 0.75 < rows[1].lost_share  # lr 1e-2 keeps most updates, 1e-7 loses them (not
    # those of weights near 0, e.g. the LayerNorm bias)
    assert rows[1].median_update_to_half_ulp < 1 < rows[0].median_update_to_half_ulp
    text = format_rounding_report(rows)
    assert "bf16-sr" in text.splitlines()[-1] and "2.weight" in text


def test_masters_are_the_weights_and_a_missing_grad_is_an_error():
    model = _model().bfloat16()
    opt = FusedAdamW(model.parameters(), lr=1e-3, master_weights=True)
    with pytest.raises(ValueError, match="no parameter"):
        rounding_loss(model, opt)
    x = torch.randn(16, 32).bfloat16()
    model(x).float().square().mean().backward()
    opt.step()
    m = opt.master_param(model[0].weight)
    m.add_(1e-3)  # the master differs from the bf16 param: the report must start from the master
    rows = rounding_loss(model, opt)
    assert rows[0].params == 6 and rows[0].updated > 0
    assert "master_param" in opt.state[model[0].weight] and opt.master_weights


@pytest.mark.slow
def test_numerics_cli_rounding_flag(tmp_path, capsys):
    import json
    from pathlib import Path

    from mptrain.cli.numerics import numerics_main

    recipe = str(Path(__file__).resolve().parents[2] / "recipes" / "quickstart.yaml")
    out = tmp_path / "rounding.json"
    assert numerics_main(["--config", recipe, "--rounding=true", "--rounding_lr=1e-5", "--device=cpu",
                          "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    rows = json.loads(out.read_text())
    assert rows and all(r["lr"] == 1e-5 for r in rows) and rows[0]["lost_share"] > 0.5
    assert "bf16-sr" in printed.splitlines()[-1]
