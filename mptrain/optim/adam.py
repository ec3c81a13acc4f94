"""FusedAdam and FusedAdamW: torch.optim.Adam / AdamW's update in one multi-tensor kernel."""
from __future__ import annotations

from mptrain.ops.multi_tensor import multi_tensor_adam

from .base import FusedOptimizer


class FusedAdam(FusedOptimizer):
    """Drop-in for ``torch.optim.Adam`` (same arguments and state keys) plus ``master_weights`` and
    ``fused``; see :mod:`mptrain.optim` for step(). ``amsgrad=True`` is not implemented by the fused
    kernel and raises; ``decoupled_weight_decay=True`` makes it AdamW, as in torch."""

    _decoupled_default = False

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False, *,
                 foreach=None, maximize=False, capturable=False, differentiable=False, fused="auto",
                 decoupled_weight_decay=None, master_weights=False):
        self._check_args(lr, betas, eps=eps, weight_decay=weight_decay)
        if decoupled_weight_decay is None:
            decoupled_weight_decay = self._decoupled_default
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                        maximize=maximize, foreach=foreach, differentiable=differentiable,
                        decoupled_weight_decay=bool(decoupled_weight_decay))
        super().__init__(params, defaults, master_weights=master_weights, capturable=capturable, fused=fused)

    @property
    def _format_defaults(self):
        # torch.optim.Adam fills these into older groups; AdamW's always decouple.
        return dict(amsgrad=False, maximize=False, foreach=None, capturable=False, differentiable=False,
                    decoupled_weight_decay=self._decoupled_default)

    def _check_group(self, group):
        name = type(self).__name__
        if group["amsgrad"]:
            raise NotImplementedError(f"{name}: amsgrad=True is not supported by the fused kernel; "
                                      "use torch.optim.Adam(amsgrad=True)")
        if group["differentiable"]:
            raise ValueError(f"{name}: differentiable=True is not supported (the step runs under no_grad); "
                             "use torch.optim.Adam(differentiable=True)")
        if self._decoupled_default and not group["decoupled_weight_decay"]:
            raise ValueError(f"{name}: a param group with decoupled_weight_decay=False is Adam, not AdamW; "
                             "load it into FusedAdam")

    def _buffers(self, group):
        return ("exp_avg", "exp_avg_sq")

    def _update(self, group, params, grads, state, masters, grad_scale, found_inf, sr=None):
        beta1, beta2 = group["betas"]
        multi_tensor_adam(grads, params, state["exp_avg"], state["exp_avg_sq"], state["step"], masters,
                          lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                          weight_decay=group["weight_decay"], decoupled=group["decoupled_weight_decay"],
                          maximize=group["maximize"], grad_scale=grad_scale, found_inf=found_inf, fused=self.fused,
                          sr=sr)


class FusedAdamW(FusedAdam):
    """Drop-in for ``torch.optim.AdamW`` (decoupled weight decay, default 1e-2)."""

    _decoupled_default = True

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False, *,
                 foreach=None, maximize=False, capturable=False, differentiable=False, fused="auto",
                 master_weights=False):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, foreach=foreach, maximize=maximize,
                         capturable=capturable, differentiable=differentiable, fused=fused,
                         decoupled_weight_decay=True, master_weights=master_weights)

