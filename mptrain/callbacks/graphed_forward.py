"""GraphedForward: the network call of a training step and its backward, replayed from CUDA graphs (cuda_graphs=True).

Installed by :class:`~mptrain.callbacks.cuda_graphs.CudaGraphs` on the LightningModule's ``forward`` and on each
direct submodule that holds trainable parameters (its ``forward``, or its compiled call when it was compiled in
place), so that whichever a ``training_step`` calls is graphed: ``self(x)``, or ``self.model(x)`` with the network
stored as ``self.model`` (or any other attribute).  Calls outside the training step's closure (validation, no_grad,
hooks) and calls nested inside the graphed one run the original code.

Inside the closure, the first steps run eagerly and record which of these modules the step called (exactly one,
exactly once: two different ones, the same one twice, or none is refused, naming them) and the inputs'
structure, shapes and dtypes; then one call is captured.  Replaying copies the inputs into static buffers and the
outputs out; the backward graph, captured at the step's backward, takes the outputs' gradients and writes the
``.grad`` of every parameter of the graphed module (the same tensors each step).  Changed inputs, another module
or a second call in one step, or a loss built from other outputs than at capture raise :class:`CudaGraphError`.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Optional

import torch

from mptrain.callbacks.graph_safety import refuse_cudagraph_trees, refuse_logging, refuse_module_hooks
from mptrain.compat import torch as compat
from mptrain.precision.graph_capture import CudaGraphError, capture

_FIX = ("forward must be a function of its tensor inputs and the parameters: do host reads and logging in "
        "training_step, which runs eagerly (e.g. BertMLM(max_predictions=N) gathers without a host sync).")
_CONSTANT = (type(None), bool, int, float, str, torch.dtype, torch.device)
_pytree = compat.pytree()
keystr, tree_flatten, tree_flatten_with_path, tree_unflatten = \
    _pytree.keystr, _pytree.tree_flatten, _pytree.tree_flatten_with_path, _pytree.tree_unflatten


class _Slot:
    """One module a training step may call, as ``call`` names it (``self(...)``, ``self.model(...)``), and the
    attribute its calls go through: ``forward``, or the compiled call ``Module.compile`` sets for a module compiled
    in place (its compiled code runs ``forward`` inside, where a wrapper would be traced)."""

    def __init__(self, module: torch.nn.Module, call: str):
        self.module, self.call = module, call
        self.attr = compat.COMPILED_CALL_ATTR if compat.compiled_call(module) is not None else "forward"
        self.had = self.attr in module.__dict__  # an instance attribute (torch.compile's, a user's): put back
        self.saved = module.__dict__.get(self.attr)
        self.eager = getattr(module, self.attr)

    def install(self, wrapper) -> None:
        # name, doc and __wrapped__ (the signature Lightning inspects); not the compiled function's dynamo attributes
        self.module.__dict__[self.attr] = functools.update_wrapper(wrapper, self.eager, updated=())

    def uninstall(self) -> None:
        if self.had:
            self.module.__dict__[self.attr] = self.saved
        else:
            self.module.__dict__.pop(self.attr, None)


class GraphedForward:
    """The graphed network call of ``pl_module``'s training step; see the module docstring."""

    def __init__(self, pl_module: torch.nn.Module):
        self.module = pl_module
        self.name = type(pl_module).__name__
        self.slots = [_Slot(pl_module, "self(...)")]
        seen = {id(pl_module)}
        for name, child in pl_module.named_children():
            if id(child) not in seen and any(p.requires_grad for p in child.parameters()):
                seen.add(id(child))
                self.slots.append(_Slot(child, f"self.{name}(...)"))
        self.target: Optional[_Slot] = None  # the module the steps call, known after the first one
        self.mode: Optional[str] = None  # inside the training step: "eager" or "graph"
        self.called: list[_Slot] = []  # this step's calls (nested calls excluded)
        self.inside = False  # a graphed module's call is running: calls within it are its own code
        self.signature: Optional[tuple] = None  # (input spec, [(path, meta)]) of the first step
        self.fwd: Optional[torch.cuda.CUDAGraph] = None
        self.bwd: Optional[torch.cuda.CUDAGraph] = None
        self.grads: list = []  # (param, the grad tensor the backward graph writes)

    @property
    def calls(self) -> int:
        """Calls of a graphable module in the current (or last) training step."""
        return len(self.called)

    def install(self) -> None:
        for slot in self.slots:
            slot.install(functools.partial(self._call, slot))

    def uninstall(self) -> None:
        for slot in self.slots:
            slot.uninstall()

    @contextlib.contextmanager
    def training_step(self, graph: bool):
        """The closure of one optimizer step: graphed (captured on first use) or eager."""
        self.mode, self.called = ("graph" if graph else "eager"), []
        try:
            yield
        finally:
            self.mode = None
        if not self.called:
            children = ", ".join(s.call for s in self.slots[1:])
            options = f"{self.name}.forward (self(...))" + (
                f" or a direct submodule with trainable parameters ({children})" if children else "")
            raise CudaGraphError(f"cuda_graphs=True graphs the one network call of each training step: {options}, but "
                                 f"{self.name}.training_step called none of them. Compute the network's output with "
                                 "one such call, or train with cuda_graphs=False")
        if self.target is None:
            self.target = self.called[0]

    def _call(self, slot: _Slot, *args: Any, **kwargs: Any) -> Any:
        if self.mode is None or self.inside or not torch.is_grad_enabled():
            return slot.eager(*args, **kwargs)
        self._count(slot)
        leaves, spec = self._check_inputs(args, kwargs)
        self.inside = True
        try:
            if self.mode == "eager":
                return slot.eager(*args, **kwargs)
            if self.fwd is None:
                self._capture_forward(leaves, spec)
            else:
                for buf, x in zip(self.static_in, leaves):
                    if buf is not None:
                        buf.copy_(x)
            self.fwd.replay()
        finally:
            self.inside = False
        return self._outputs()

    def _count(self, slot: _Slot) -> None:
        """One call per step, of one module, the same every step: else refused, naming the calls."""
        self.called.append(slot)
        first = self.called[0]
        if slot is not first:
            raise CudaGraphError(
                f"cuda_graphs=True graphs one network call per training step, and {self.name}.training_step called "
                f"{first.call} and {slot.call}: call one module that runs the whole network (e.g. a forward that "
                f"calls both, through self(...)), or train with cuda_graphs=False")
        if len(self.called) > 1:
            raise CudaGraphError(f"cuda_graphs=True graphs one forward call per training step; {self.name}."
                                 f"training_step called {slot.call} again: call it once")
        if self.target is not None and slot is not self.target:
            raise CudaGraphError(
                f"cuda_graphs=True graphs the module the first training step called ({self.target.call}), but at "
                f"step {self._step()} training_step called {slot.call}: call the same module every step, or train "
                f"with cuda_graphs=False")

    def _step(self):
        return getattr(getattr(self.module, "_trainer", None), "global_step", "?")

    # -- inputs -----------------------------------------------------------------
    def _check_inputs(self, args: tuple, kwargs: dict) -> tuple[list, Any]:
        with_path, spec = tree_flatten_with_path((args, kwargs))
        meta = [(("args" if path[0].idx == 0 else "kwargs") + keystr(path[1:]), _meta(x)) for path, x in with_path]
        if self.signature is None:
            for name, m in meta:
                if m[0] == "object":
                    raise CudaGraphError(f"cuda_graphs=True: forward input {name} is a {m[1]}, which torch's pytree "
                                         "cannot look into; pass tensors, or tuples, lists or dicts of them")
            self.signature = (spec, meta)
        elif (spec, meta) != self.signature:
            raise CudaGraphError(self._changed(spec, meta))
        return [x for _, x in with_path], spec

    def _changed(self, spec: Any, meta: list) -> str:
        head = f"cuda_graphs=True replays one captured forward, but at step {self._step()} "
        if spec != self.signature[0]:
            what = f"the inputs' structure changed from {self.signature[0]} to {spec}"
        else:
            path, old, new = next((p, o, n) for (p, o), (_, n) in zip(self.signature[1], meta) if o != n)
            what = f"forward input {path} is {_show(new)}; the first steps had {_show(old)}"
        return (head + what + ". Give every batch one shape (pad, or drop_last=True for the last batch), "
                "or train with cuda_graphs=False.")

    # -- capture and replay ---------------------------------------------------------
    def _capture_forward(self, leaves: list, spec: Any) -> None:
        refuse_module_hooks(self.target.module)
        refuse_cudagraph_trees()
        device = next(self.target.module.parameters(), None)
        device = (device if device is not None else next(self.module.parameters())).device
        for (path, m) in self.signature[1]:
            if m[0] == "tensor" and (m[3] or m[2] != device):
                raise CudaGraphError(f"cuda_graphs=True: forward input {path} is {_show(m)}; graphed inputs must be "
                                     f"tensors on {device} that do not require grad (compute such inputs in forward)")
        self.static_in = [x.detach().clone() if isinstance(x, torch.Tensor) else None for x in leaves]
        args, kwargs = tree_unflatten([s if s is not None else x for s, x in zip(self.static_in, leaves)], spec)
        self.pool = torch.cuda.graph_pool_handle()
        self.fwd = torch.cuda.CUDAGraph()
        with refuse_logging(self.module), capture(self.fwd, self.pool, "the training forward", _FIX):
            out = self.target.eager(*args, **kwargs)
        self.static_out, self.out_spec = tree_flatten(out)
        for o in self.static_out:
            if not isinstance(o, (torch.Tensor,) + _CONSTANT):
                raise CudaGraphError(f"cuda_graphs=True: forward returned a {type(o).__name__}, which torch's pytree "
                                     "cannot look into; return tensors, or tuples, lists or dicts of them")
        self.diff = [i for i, o in enumerate(self.static_out) if isinstance(o, torch.Tensor) and o.requires_grad]
        # a leaf that requires grad makes the outputs require grad; its own grad is always None
        self.anchor = torch.zeros((), device=device, requires_grad=True)

    def _outputs(self) -> Any:
        outs = list(self.static_out)
        if self.diff:  # copied by _Backward, which replays the backward graph
            for i, t in zip(self.diff, _Backward.apply(self, self.anchor)):
                outs[i] = t
        outs = [o.detach().clone() if isinstance(o, torch.Tensor) and not o.requires_grad else o for o in outs]
        return tree_unflatten(outs, self.out_spec)

    def backward(self, grads: tuple) -> None:
        present = tuple(g is not None for g in grads)
        if not any(present):
            return
        if self.bwd is None:
            self._capture_backward(present)
        elif present != self.present:
            raise CudaGraphError("cuda_graphs=True: the loss uses other outputs of forward than in the captured "
                                 "step; compute it from the same outputs every step, or use cuda_graphs=False")
        for buf, g in zip(self.grad_out, (g for g in grads if g is not None)):
            buf.copy_(g)
        self.bwd.replay()
        for p, g in self.grads:
            if p.grad is None:  # zero_grad(set_to_none=True) since the last step
                p.grad = g
            elif p.grad is not g:  # the parameter is also used outside forward and its eager grad came first
                g.add_(p.grad)
                p.grad = g

    def _capture_backward(self, present: tuple) -> None:
        self.present = present
        outs = [self.static_out[i] for i, used in zip(self.diff, present) if used]
        self.grad_out = [torch.empty_like(o) for o in outs]
        params = [p for p in self.target.module.parameters() if p.requires_grad]
        self.bwd = torch.cuda.CUDAGraph()
        with capture(self.bwd, self.pool, "the training backward", _FIX):
            grads = torch.autograd.grad(outs, params, self.grad_out, allow_unused=True)
            # each grad laid out like its parameter, as autograd's accumulation would (no expanded views)
            grads = [g if g is None or g.stride() == p.stride() else torch.empty_like(p).copy_(g)
                     for p, g in zip(params, grads)]
        self.grads = [(p, g) for p, g in zip(params, grads) if g is not None]
        self.static_out = [o.detach() if isinstance(o, torch.Tensor) else o for o in self.static_out]


class _Backward(torch.autograd.Function):
    """Copies of the differentiable outputs; their backward replays the backward graph."""

    @staticmethod
    def forward(ctx, graphed: GraphedForward, anchor: torch.Tensor):
        ctx.graphed = graphed
        ctx.set_materialize_grads(False)
        return tuple(graphed.static_out[i].detach().clone() for i in graphed.diff)

    @staticmethod
    def backward(ctx, *grads):
        ctx.graphed.backward(grads)
        return None, None


def _meta(x: Any) -> tuple:
    if isinstance(x, torch.Tensor):
        return ("tensor", tuple(x.shape), x.device, x.requires_grad, x.dtype)
    if isinstance(x, _CONSTANT):
        return ("value", type(x).__name__, x)
    return ("object", type(x).__name__, id(x))


def _show(meta: tuple) -> str:
    if meta[0] == "tensor":
        return f"a {meta[4]} tensor of shape {meta[1]} on {meta[2]}{' requiring grad' if meta[3] else ''}"
    return f"the {meta[1]} {meta[2]!r}"

