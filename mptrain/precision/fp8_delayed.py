"""``fp8-master``'s delayed recipe: activation and gradient scales known before the step, so casts fuse.

Under tensorwise *current* scaling (``recipe="tensorwise"``) each cast of an activation or an output gradient
needs that tensor's amax first: a reduction over the whole tensor, then a second pass that scales and casts.
Under ``torch.compile`` the two passes stay two kernels (the cast cannot start before the reduction has seen
the last element), and the producer of the tensor (an RMSNorm, the SwiGLU, attention's output) runs before
them as a third.  With *delayed* scaling (Transformer Engine's recipe; torchao had it until 0.9) the scale of
step ``t`` comes from the amaxes recorded over the steps before it: the cast is a pointwise function of the
producer's output that inductor fuses into the producer's kernel.  This step's amax, recorded for the next steps,
is a reduction over the same elements; on an H100 inductor computes it in a kernel of its own (docs/fp8.md).

What this module keeps per fp8 linear (:class:`DelayedFp8Linear`):

- the input's scale and the output gradient's scale (0-d fp32 tensors, read by the compiled graph);
- the input's amax over the current optimizer step (a running max, written by the forward);
- a 0-d *sink*: a leaf tensor that the backward hands the output gradient's amax to as its "gradient", so the
  amax leaves the compiled backward as an ordinary gradient (no mutation inside a backward graph);
- a history of the last ``HISTORY`` steps' amaxes per role, held by :class:`DelayedScaling` for all layers in
  one tensor: at the end of each optimizer step it rolls in the step's amaxes and sets every scale to
  ``fp8_max / max(history)`` in a few kernels (device-side: no host sync).

Layers that read the very same input tensor (q, k and v; gate and up) share one input scale, set from the largest
amax among them (``_InputGroups``, found in the first step): their casts become one expression that the compiler
computes and saves once, as it already does for the identical current-scaling casts of the tensorwise recipe.

The weight keeps current scaling: it is read whole by the cast anyway, and a weight's amax moves little.

The first optimizer step has no history: it runs with current scaling (``fp8_ready`` False: the tensorwise path,
amaxes recorded), and the delayed path starts at the second step.  The plugin runs that first step eagerly
(``torch.compiler.set_stance("force_eager")`` in its forward context), so ``torch.compile`` traces the model once,
with delayed scales.  A cast whose scale has fallen behind a growing tensor saturates at the fp8 format's largest
value (torchao's saturated cast): the plugin counts the steps in which that happened per layer
(``Fp8Precision.fp8_saturated_steps``), and ``mptrain numerics --fp8 true --fp8_recipe delayed`` measures it on a
recipe's data before a run.
"""
from __future__ import annotations

import functools
import weakref
from typing import Any, Iterable, Optional

import torch
from torch import nn

from mptrain.compat import torch as compat
from mptrain.precision import fp8_linear
from mptrain.precision.fp8_linear import _cast, fp8_linear_class, tensor_amax

#: steps of amax history per tensor; the scale follows the largest amax among them
HISTORY = 16


class _DelayedFp8Matmul(torch.autograd.Function):
    """``input @ weight.t()`` with the input and the output gradient cast at the given scales; the output
    gradient's amax comes back as the gradient of ``grad_amax_sink``."""

    @staticmethod
    def forward(ctx, input_hp, weight_hp, input_scale, grad_scale, grad_amax_sink, mm_config, config):
        T = fp8_linear.torchao_linear
        shape = input_hp.shape
        x = fp8_linear.cast_with_scale(input_hp.reshape(-1, shape[-1]), input_scale,
                                       config.cast_config_input.target_dtype, mm_config, T.GemmInputRole.INPUT)
        w_t = _cast(T, weight_hp.t(), config.cast_config_weight.target_dtype, mm_config, T.GemmInputRole.WEIGHT)
        ctx.save_for_backward(x, w_t, grad_scale)
        ctx.mm_config, ctx.config, ctx.input_shape = mm_config, config, shape
        out = torch.mm(x, w_t)
        return out.reshape(*shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_output):
        T = fp8_linear.torchao_linear
        x, w_t, grad_scale = ctx.saved_tensors
        g_hp = grad_output.reshape(-1, grad_output.shape[-1])
        g = fp8_linear.cast_with_scale(g_hp, grad_scale, ctx.config.cast_config_grad_output.target_dtype,
                                       ctx.mm_config, T.GemmInputRole.GRAD_OUTPUT)
        grad_input = grad_weight = None
        if ctx.needs_input_grad[0]:
            grad_input = torch.mm(g, w_t.t()).reshape(*ctx.input_shape[:-1], -1)
        if ctx.needs_input_grad[1]:
            grad_weight = torch.mm(g.t(), x)
        return grad_input, grad_weight, None, None, tensor_amax(g_hp), None, None


class _RecordGradAmax(torch.autograd.Function):
    """Identity forward; the backward hands the output gradient's amax to ``sink`` (the first step's path)."""

    @staticmethod
    def forward(ctx, x, sink):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, tensor_amax(grad)


@functools.lru_cache(maxsize=None)
def delayed_fp8_linear_class() -> Optional[type]:
    """:class:`DelayedFp8Linear`, made on first use (torchao is imported only by a run that converts layers)."""
    base = fp8_linear_class()
    if base is None:
        return None

    class DelayedFp8Linear(base):
        """An :class:`~mptrain.precision.fp8_linear.Fp8Linear` whose input and output-gradient casts use delayed
        scales (module docstring).  Its state is attached by :class:`DelayedScaling` on the layer's device."""

        fp8_ready: bool = False  # False: current scaling (no history yet), amaxes recorded all the same

        def forward(self, input: torch.Tensor) -> torch.Tensor:
            if torch.is_autocast_enabled():  # as torchao's forward: the output in autocast's dtype
                input = input.to(torch.get_autocast_gpu_dtype())
            training = torch.is_grad_enabled()
            if training:  # this step's input amax, for the next steps' scales
                self.fp8_input_amax.copy_(torch.maximum(self.fp8_input_amax, tensor_amax(input)))
            if not self.fp8_ready:  # no history yet: current scales, the output gradient's amax recorded
                if training:
                    self.fp8_inputs.note(self.fp8_index, input)
                out = base.forward(self, input)
                return _RecordGradAmax.apply(out, self.fp8_grad_amax) if training else out
            out = _DelayedFp8Matmul.apply(input, self.weight, self.fp8_input_scale, self.fp8_grad_scale,
                                          self.fp8_grad_amax, self.linear_mm_config, self.config)
            return out if self.bias is None else out + self.bias.to(out.dtype)

    DelayedFp8Linear.__module__, DelayedFp8Linear.__qualname__ = __name__, "DelayedFp8Linear"
    return DelayedFp8Linear


def __getattr__(name: str) -> Any:
    if name == "DelayedFp8Linear":
        cls = delayed_fp8_linear_class()
        if cls is not None:
            return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class _InputGroups:
    """Which layers read the very same input tensor in the first step (a decoder's q, k and v projections, an MLP's
    gate and up projections): each layer's *leader*, the first layer that read its input.

    Layers of one group share one input scale tensor, set from the largest amax any of them recorded, so that their
    casts are one expression of one graph input: the compiler's common-subexpression pass then makes one fp8 copy of
    the input, cast once and saved once for backward, where three scales would cast and save it three times.
    Weak references: the first step's inputs are not kept alive for this."""

    def __init__(self, n: int):
        self.leader: list[Optional[int]] = [None] * n
        self._seen: list[tuple[weakref.ref, int]] = []

    def note(self, index: int, input: torch.Tensor) -> None:
        if self.leader[index] is not None:  # grouped by the first micro-batch already
            return
        for ref, leader in self._seen:
            if ref() is input:
                self.leader[index] = leader
                return
        self.leader[index] = index
        self._seen.append((weakref.ref(input), index))

    def __getstate__(self) -> dict[str, Any]:  # a model pickled mid-step: weak references do not pickle
        return {"leader": list(self.leader), "_seen": []}

    def done(self) -> list[int]:
        """Each layer's leader (a layer the first step never called leads itself); the references dropped."""
        self._seen = []
        return [i if lead is None else lead for i, lead in enumerate(self.leader)]


class DelayedScaling:
    """The amax histories and scales of a model's :class:`DelayedFp8Linear` layers, updated once per optimizer
    step by the fp8-master plugin (``end_step``).  ``layers``: qualified name -> layer."""

    def __init__(self, layers: dict[str, nn.Module], device: torch.device):
        self.names = list(layers)
        self.layers = [layers[n] for n in self.names]
        n = len(self.layers)
        # rows: each layer's input, then each layer's output gradient; columns: steps, newest first
        self.history = torch.zeros(2 * n, HISTORY, device=device)
        f8 = [(m.config.cast_config_input.target_dtype, m.config.cast_config_grad_output.target_dtype)
              for m in self.layers]
        self.fp8_max = torch.tensor([torch.finfo(a).max for a, _ in f8] + [torch.finfo(b).max for _, b in f8],
                                    device=device)
        self._groups = _InputGroups(n)
        #: each layer's input-scale leader (``_InputGroups``); every layer its own until the first step ends
        self.input_leader = list(range(n))
        self._leader_index: Optional[torch.Tensor] = None  # the same on the device, where some layers share
        for i, m in enumerate(self.layers):
            m.fp8_index, m.fp8_inputs = i, self._groups
            m.fp8_input_amax = torch.zeros((), device=device)
            m.fp8_input_scale = torch.ones((), device=device)
            m.fp8_grad_scale = torch.ones((), device=device)
            m.fp8_grad_amax = torch.zeros((), device=device, requires_grad=True)  # the sink: a leaf
            m.fp8_ready = False
        self._grad_amax = [torch.zeros((), device=device) for _ in self.layers]  # the window's, folded by backward
        #: per row (as ``history``): in how many steps the cast at the step's scale saturated (the amax the step
        #: recorded, times the scale it ran at, beyond the format's largest value)
        self.saturated = torch.zeros(2 * n, dtype=torch.int64, device=device)
        self.steps = 0

    def _set_scales(self) -> None:
        """Every scale from its history: the largest amax maps to the format's largest value; a tensor never seen
        above 0 (an all-zero input) keeps scale 1."""
        top = self.history.amax(dim=1)
        leader = self._leader_index
        if leader is not None:  # a group's input scale follows the largest amax among its layers
            n = len(self.layers)
            group_top = torch.zeros(n, device=top.device).scatter_reduce(0, leader, top[:n], "amax")
            top = torch.cat([group_top[leader], top[n:]])
        scales = torch.where(top > 0, self.fp8_max / top.clamp(min=torch.finfo(torch.float32).tiny), 1.0)
        # into the layers' own tensors: a compiled graph takes them as inputs, the same objects every step
        compat.foreach_copy_(self._scales(), list(scales.unbind()))

    def _scales(self) -> list[torch.Tensor]:
        """The layers' scale tensors, in ``history``'s row order."""
        return [m.fp8_input_scale for m in self.layers] + [m.fp8_grad_scale for m in self.layers]

    @torch.no_grad()
    def fold_grad_amaxes(self) -> None:
        """After a backward: the sinks' amaxes into the window's running max, the sinks cleared (their gradients
        would sum over an accumulation window's micro-batches)."""
        pairs = [(r, s.grad) for r, s in zip(self._grad_amax, self._sinks()) if s.grad is not None]
        if pairs:
            running, grads = map(list, zip(*pairs))
            torch._foreach_maximum_(running, grads)
            torch._foreach_zero_(grads)

    def _sinks(self) -> list[torch.Tensor]:
        return [m.fp8_grad_amax for m in self.layers]

    @torch.no_grad()
    def update(self) -> None:
        """End of an optimizer step: count the casts that saturated, roll in the step's amaxes (a non-finite one as
        0: a skipped step's overflow must not wipe the scales for ``HISTORY`` steps), recompute every scale, clear
        the amaxes (what a backward left in the sinks is folded in first)."""
        self.fold_grad_amaxes()
        now = torch.stack([m.fp8_input_amax for m in self.layers] + self._grad_amax)
        now = torch.where(torch.isfinite(now), now, torch.zeros_like(now))
        if self.steps > 0:  # this step ran at delayed scales
            self.saturated += now * torch.stack(self._scales()) > self.fp8_max
        self.history.copy_(torch.cat([now[:, None], self.history[:, :-1]], dim=1))
        if self.steps == 0:  # the first step found the input groups
            self._share_input_scales(self._groups.done())
        self._set_scales()
        torch._foreach_zero_([m.fp8_input_amax for m in self.layers] + self._grad_amax)
        self.steps += 1
        if self.steps == 1:
            for m in self.layers:
                m.fp8_ready = True

    def _share_input_scales(self, leader: list[int]) -> None:
        """Layers that read one input take their leader's input-scale tensor (``_InputGroups``); the caller sets the
        scales, which then follow the groups' amaxes."""
        self.input_leader = list(leader)
        shared = self.input_leader != list(range(len(self.layers)))
        # on the device once: a host list copied up at every step's update would wait for the GPU
        self._leader_index = torch.tensor(self.input_leader, device=self.history.device) if shared else None
        for m, lead in zip(self.layers, leader):
            m.fp8_input_scale = self.layers[lead].fp8_input_scale

    def saturated_steps(self) -> dict[str, dict[str, int]]:
        """``{layer: {"input": steps, "grad_output": steps}}`` for the casts that saturated in some step (one host
        read)."""
        counts = self.saturated.tolist()
        n = len(self.layers)
        out = {}
        for i, name in enumerate(self.names):
            row = {k: c for k, c in (("input", counts[i]), ("grad_output", counts[n + i])) if c}
            if row:
                out[name] = row
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"names": list(self.names), "history": self.history.cpu(), "steps": self.steps,
                "saturated": self.saturated.cpu(), "input_leader": list(self.input_leader)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if list(state["names"]) != self.names:
            raise ValueError("the checkpoint's fp8 delayed-scaling state names other layers than this model's "
                             f"({len(state['names'])} vs {len(self.names)}): resume with the model it was saved from")
        self.history.copy_(state["history"])
        if "saturated" in state:
            self.saturated.copy_(state["saturated"])
        self.steps = state["steps"]
        if self.steps > 0:  # the scales follow from the history (and the input groups) alone
            self._groups.done()
            self._share_input_scales(state.get("input_leader", range(len(self.layers))))
            self._set_scales()
            for m in self.layers:
                m.fp8_ready = True


def use_delayed_scaling(module: nn.Module, device: torch.device) -> DelayedScaling:
    """Every :class:`~mptrain.precision.fp8_linear.Fp8Linear` inside ``module`` becomes a
    :class:`DelayedFp8Linear` in place (same Parameters); returns their scaling state."""
    single, delayed = fp8_linear_class(), delayed_fp8_linear_class()
    layers = {}
    for name, m in module.named_modules():
        if type(m) in (single, delayed):
            m.__class__ = delayed
            layers[name] = m
    return DelayedScaling(layers, device)


def drop_delayed_state(layers: Iterable[nn.Module]) -> None:
    """The layers' delayed-scaling attributes removed (the layers are turned into ``nn.Linear`` by the caller)."""
    for m in layers:
        for a in ("fp8_input_amax", "fp8_input_scale", "fp8_grad_scale", "fp8_grad_amax", "fp8_ready", "fp8_index",
                  "fp8_inputs"):
            m.__dict__.pop(a, None)
