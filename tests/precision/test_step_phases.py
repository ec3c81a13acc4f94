"""The precision plugin's public step phases: driven by hand they train exactly as the plugin's own step, a step
runner takes optimizer_step over without patching the plugin, and a replayed check can be handed back."""
from __future__ import annotations

import torch
from torch import nn

from mptrain.precision import MasterPrecision
from mptrain.precision.plugin import StepCheck

STEPS, INF_AT = 5, 2


def _train(by_hand: bool):
    torch.manual_seed(0)
    plugin = MasterPrecision("bf16-master", loss_scaler={"init_scale": 2.0**8})
    model = plugin.convert_module(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        loss = model(torch.randn(4, 8, dtype=torch.bfloat16)).float().pow(2).mean()
        plugin.backward(loss * float("inf") if step == INF_AT else loss, model)
        if by_hand:  # the order the class docstring gives
            opt = plugin.prepare_optimizer(optimizer)
            found = plugin.unscale_and_check(opt)
            assert plugin.unscale_and_check(opt) is found and plugin.step_check(opt).found_inf is found
            plugin.apply_step(opt, found)
            plugin.finish_step(opt, found)
            assert plugin.step_check(opt) is None  # the step ended
        else:
            plugin.optimizer_step(optimizer)  # Fabric's call
    return [p.detach().clone() for p in model.parameters()], plugin.skipped_steps, plugin.loss_scaler.scale


def test_phases_by_hand_train_exactly_as_optimizer_step():
    (w0, s0, scale0), (w1, s1, scale1) = _train(by_hand=False), _train(by_hand=True)
    assert all(torch.equal(a, b) for a, b in zip(w0, w1))
    assert s0 == s1 == 1 and scale0 == scale1


class _Runner:
    def __init__(self):
        self.calls = []

    def optimizer_step(self, optimizer, model, closure, **kwargs):
        self.calls.append((optimizer, model, closure, kwargs))
        return "ran"


def test_a_step_runner_takes_optimizer_step_over_without_patching():
    plugin = MasterPrecision("bf16-master")
    runner = _Runner()
    plugin.step_runner = runner
    assert plugin.optimizer_step("opt", model="m", closure="c", x=1) == "ran"
    assert runner.calls == [("opt", "m", "c", {"x": 1})] and "optimizer_step" not in vars(plugin)


def test_a_replayed_check_is_handed_back_and_the_loss_flag_moves_into_a_buffer():
    plugin = MasterPrecision("bf16-master", loss_scaler={"init_scale": 4.0})
    model = plugin.convert_module(nn.Linear(4, 4))
    opt = plugin.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    plugin.backward(model(torch.randn(2, 4, dtype=torch.bfloat16)).float().sum() * float("inf"), model)
    buffer = torch.zeros(1)
    plugin.keep_loss_flag_in(buffer)
    assert buffer.item() == 1.0 and plugin.unscale_and_check(opt).item() == 1.0  # the check reads the buffer
    plugin.end_step(opt)
    plugin.keep_loss_flag_in(buffer)  # a window whose loss was finite
    assert buffer.item() == 0.0
    refilled = torch.ones(1)
    plugin.set_step_check(opt, StepCheck(refilled))
    assert plugin.unscale_and_check(opt) is refilled and plugin.step_check(opt).found_inf is refilled
