"""Fused optimizers: one multi-tensor kernel per step, optional fp32 master weights.

``FusedAdam``, ``FusedAdamW``, ``FusedSGD`` and ``FusedLAMB`` are ``torch.optim.Optimizer``
subclasses taking torch's argument names plus:

* ``master_weights=False``: with True, every fp16/bf16 param is updated through an fp32 copy kept
  in the state under ``'master_param'`` (made at its first step, or by ``optimizer.master_param(p)``);
  one kernel reads the half grad, the master and the fp32 moments and writes them and the half param.
  fp32 params ignore the flag. The state_dict round-trips in fp32.
* ``enable_stochastic_rounding(seed)`` (what precision ``bf16-sr`` calls): bf16 params without masters, fp32
  moments; each new weight is written to bf16 with stochastic rounding from Philox bits keyed by (seed, step),
  counter (tensor, element) (:func:`mptrain.ops.stochastic_round`), reproducible from the seed.
* ``capturable=False``: the step never syncs with the host either way (step counts live on the
  device); True (CUDA params only, as in torch) also keeps each group's ``lr`` as a float32 device
  tensor that LR schedulers fill in place, so a captured or compiled step follows the schedule.
* ``fused="auto"``: the CUDA kernel for CUDA params, else the reference (:mod:`mptrain.ops.reference`,
  torch.optim's update within 1e-6 in fp32; one warning if the extension failed to build).
  True insists on the kernel, False always uses the reference.

Drop-in parity with torch.optim: deepcopy and pickling keep every attribute; ``load_state_dict`` takes
any torch.optim format (see :mod:`.torch_format`) and our state_dict loads into torch's; params and grads
of any layout are stepped. Options the kernels cannot run (``amsgrad``, ``differentiable``) raise, also
from a loaded state.

Loss scaling: ``optimizer.step(grad_scale=scale, found_inf=found_inf, unscale_grads=True)``.

* ``grad_scale``: the loss scale (float32 1-element tensor, or a float); the update divides the
  grads by it in fp32, and each grad is left holding ``grad / grad_scale`` (what torch's fused
  optimizers leave) unless ``unscale_grads=False``, which saves one pass over them.
* ``found_inf``: a float32 1-element tensor on the params' device. The step checks every grad and
  sets it to 1 on an inf/NaN, in place on the device; a non-zero ``found_inf`` (set before or by that
  check) makes the step change nothing (params, masters, moments, step counts, grads). Passing either
  argument turns the check on (a zero found_inf is made if only ``grad_scale`` is given).

``torch.amp.GradScaler`` works too (``_step_supports_amp_scaling``): it sets ``optimizer.grad_scale``
/ ``optimizer.found_inf`` before ``step()``, read with torch's fused-optimizer semantics (grads left
unscaled, found_inf trusted, no second check). ``torch.compile`` traces the step without a graph
break (the kernels are custom ops); pass ``lr`` as a tensor so a schedule does not recompile.
"""
from .adam import FusedAdam, FusedAdamW
from .base import FusedOptimizer
from .lamb import FusedLAMB
from .sgd import FusedSGD

__all__ = ["FusedAdam", "FusedAdamW", "FusedSGD", "FusedLAMB", "FusedOptimizer"]
