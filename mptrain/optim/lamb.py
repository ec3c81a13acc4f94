"""FusedLAMB: layer-wise adaptive moments (You et al., 2019) in three list-wide launches."""
from __future__ import annotations

from mptrain.ops.multi_tensor import multi_tensor_lamb

from .base import FusedOptimizer


class FusedLAMB(FusedOptimizer):
    """LAMB with torch-style arguments; see :mod:`mptrain.optim` for step(). Per tensor: ``m, v`` as in
    Adam; ``u = m_hat / (sqrt(v_hat) + eps) + weight_decay * w``; ``w -= lr * (||w|| / ||u||) * u`` (ratio
    1 when either norm is 0). State keys ``exp_avg``, ``exp_avg_sq``, ``step`` (and ``master_param``).
    No gradient clipping inside: clip before the step (``mptrain.ops.multi_tensor_l2norm``)."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01, bias_correction=True, *,
                 maximize=False, capturable=False, fused="auto", master_weights=False):
        self._check_args(lr, betas, eps=eps, weight_decay=weight_decay)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        bias_correction=bias_correction, maximize=maximize, differentiable=False)
        super().__init__(params, defaults, master_weights=master_weights, capturable=capturable, fused=fused)

    _format_defaults = dict(bias_correction=True, maximize=False, capturable=False, differentiable=False)

    def _buffers(self, group):
        return ("exp_avg", "exp_avg_sq")

    def _update(self, group, params, grads, state, masters, grad_scale, found_inf, sr=None):
        beta1, beta2 = group["betas"]
        multi_tensor_lamb(grads, params, state["exp_avg"], state["exp_avg_sq"], state["step"], masters,
                          lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                          weight_decay=group["weight_decay"], bias_correction=group["bias_correction"],
                          maximize=group["maximize"], grad_scale=grad_scale, found_inf=found_inf, fused=self.fused,
                          sr=sr)
