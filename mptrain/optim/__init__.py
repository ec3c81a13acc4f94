"""Fused optimizers: one multi-tensor kernel per step, optional fp32 master weights.

``FusedAdam``, ``FusedAdamW``, ``FusedSGD`` and ``FusedLAMB`` are ``torch.optim.Optimizer``
subclasses taking torch's argument names plus:

* ``master_weights=False``: with True, every fp16/bf16 param is updated through an fp32
  copy kept in the optimizer state under ``'master_param'`` (created from the param at
  its first step, or by ``optimizer.master_param(p)``); one kernel reads the half
  grad, the master and the moments and writes the master, the moments and the half
  param. Moments of such params are fp32. fp32 params ignore the flag. The state_dict
  round-trips in fp32 (torch's loader would cast the state to half).
* ``capturable=False``: on CUDA the step never syncs with the host either way (step
  counts live on the device, ``lr`` may be a CUDA tensor); True (CUDA params only, as
  in torch) also keeps each group's ``lr`` as a float32 tensor on the device, which
  torch's LR schedulers fill in place, so a step captured in a CUDA graph or compiled
  follows the schedule without a recapture.
* ``fused="auto"``: the CUDA kernel for CUDA params, else (CPU params, or the extension
  failed to build: one warning) the reference in :mod:`mptrain.ops.reference`, which
  follows torch.optim's update rule (within 1e-6 in fp32). True insists on the
  kernel, False always uses the reference.

Drop-in parity with torch.optim: ``copy.deepcopy`` and pickling keep every attribute
(``master_weights``, ``fused``, defaults, groups, state); ``load_state_dict`` takes any
torch.optim format (numeric ``step``, groups without the newer keys, states saved by
``torch.optim.Adam/AdamW/SGD``, fused or not) and our state_dict loads into those;
params and grads of any layout (transposed, sliced, channels_last, expanded grads) are
stepped, through dense working copies where the kernels need them. Group options the
kernels cannot run (``amsgrad``, ``differentiable``) raise, also from a loaded state.

step() and loss scaling — the interface the precision engine calls::

    optimizer.step(grad_scale=scale, found_inf=found_inf, unscale_grads=True)

* ``grad_scale``: the loss scale (a float32 1-element tensor, or a float). The update
  divides the grads by it in fp32; afterwards each grad holds ``grad / grad_scale``
  (what torch's fused optimizers leave), unless ``unscale_grads=False``, which leaves
  them as they were and saves one pass over them.
* ``found_inf``: a float32 1-element tensor on the params' device. The step first
  checks every grad for inf/NaN and sets ``found_inf`` to 1 if it finds one (in
  place, on the device); a non-zero ``found_inf`` — set by the caller before, or by
  that check — makes the step change nothing at all (params, masters, moments, step
  counts and grads stay bit-for-bit the same). No host sync, so the precision engine
  learns about the overflow from the same tensor and adjusts its scale on the device.
  Passing either argument turns the check on (a zero found_inf is created if only
  ``grad_scale`` is given).

``torch.amp.GradScaler`` is supported too: these classes set
``_step_supports_amp_scaling``, so the scaler skips its own unscale, computes
``found_inf`` and sets ``optimizer.grad_scale`` / ``optimizer.found_inf`` as attributes
before calling ``step()``. Those attributes are read with torch's fused-optimizer
semantics: grads divided by ``grad_scale`` in the update and left unscaled, the step
skipped (grads untouched) when ``found_inf`` is non-zero, ``found_inf`` trusted as
computed (no second check).

``torch.compile(optimizer.step)`` (or a compiled training step) traces the step with no
graph break on the reference path; pass ``lr`` as a tensor so a schedule does not
recompile on older torch. The CUDA kernels are opaque to dynamo until they are
registered as custom ops (``torch.ops.mptrain``): there the graph breaks at the kernel
call, with the same numbers.
"""
from .adam import FusedAdam, FusedAdamW
from .base import FusedOptimizer
from .lamb import FusedLAMB
from .sgd import FusedSGD

__all__ = ["FusedAdam", "FusedAdamW", "FusedSGD", "FusedLAMB", "FusedOptimizer"]
