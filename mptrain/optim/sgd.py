"""FusedSGD: torch.optim.SGD's update (momentum, dampening, Nesterov, weight decay) in one kernel."""
from __future__ import annotations

from mptrain.ops.multi_tensor import multi_tensor_sgd

from .base import FusedOptimizer


class FusedSGD(FusedOptimizer):
    """Drop-in for ``torch.optim.SGD`` (same arguments, state key ``momentum_buffer``) plus
    ``master_weights`` and ``fused``; see :mod:`mptrain.optim` for step(). The state also holds a
    ``step`` count: 0 tells the kernel, on the device, that the momentum buffer is new (torch starts it
    as the grad), so a skipped first step keeps the next one a first step."""

    def __init__(self, params, lr=1e-3, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False, *,
                 maximize=False, foreach=None, differentiable=False, fused="auto", capturable=False,
                 master_weights=False):
        self._check_args(lr, momentum=momentum, weight_decay=weight_decay)
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay, nesterov=nesterov,
                        maximize=maximize, foreach=foreach, differentiable=differentiable)
        super().__init__(params, defaults, master_weights=master_weights, capturable=capturable, fused=fused)

    # torch.optim.SGD fills these into older groups.
    _format_defaults = dict(nesterov=False, maximize=False, foreach=None, differentiable=False, capturable=False)

    def _check_group(self, group):
        name = type(self).__name__
        if group["nesterov"] and (group["momentum"] <= 0 or group["dampening"] != 0):
            raise ValueError(f"{name}: Nesterov momentum requires a momentum and zero dampening, got momentum="
                             f"{group['momentum']}, dampening={group['dampening']}")
        if group["differentiable"]:
            raise ValueError(f"{name}: differentiable=True is not supported (the step runs under no_grad); "
                             "use torch.optim.SGD(differentiable=True)")

    def _buffers(self, group):
        return ("momentum_buffer",) if group["momentum"] != 0 else ()

    def _update(self, group, params, grads, state, masters, grad_scale, found_inf, sr=None):
        multi_tensor_sgd(grads, params, state.get("momentum_buffer", []), state["step"], masters, lr=group["lr"],
                         momentum=group["momentum"], dampening=group["dampening"],
                         weight_decay=group["weight_decay"], nesterov=group["nesterov"], maximize=group["maximize"],
                         grad_scale=grad_scale, found_inf=found_inf, fused=self.fused, sr=sr)
