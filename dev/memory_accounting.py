"""What each precision mode keeps alive in a training step of a user's model, measured on the CPU.

Trains a plain LightningModule (mptrain.bench.user_models: transformers' BertForMaskedLM, torchvision's
ResNet-50, both as ``self.model`` with torch's AdamW/SGD, ``fused=False``) for a few steps under
``mptrain.Trainer(precision="bf16-master")`` and ``lightning.Trainer(precision="bf16-mixed" / "bf16-true")``,
with every tensor storage followed from its birth (a TorchDispatchMode) to its death (a finalizer), and
in the last step records:

(a) the bytes saved for backward at the end of the forward: unique storages (by data pointer) packed by
    ``torch.autograd.graph.saved_tensors_hooks``, in total, beyond the model's own parameters, and by
    (module type, op, dtype);
(b) after the optimizer step, the live bytes by role: parameters, buffers, grads, fp32 masters, the masters'
    grads, optimizer state, fp32 init copies (``MasterPrecision._fp32_init``), anything else;
(c) after every op of the step, the live bytes by role: each phase's peak (forward, backward, optimizer) and
    what was alive there -- a transient full-size copy shows up as "other" (or a second grad set) at a peak.

CPU autocast runs layer_norm and softmax in bf16 where CUDA autocast runs them in fp32, and the GPU is where
the memory matters: by default CUDA autocast's fp32 list is emulated on the CPU (``--autocast-lists cuda``:
AutocastCPU kernels for layer_norm, group_norm, rms_norm, softmax, log_softmax and logsumexp that upcast as
CUDA's do; cross_entropy, nll_loss, mse_loss, kl_div and bce_with_logits are fp32 on both).

Every number is also scaled to the GPU benchmark's size (BERT-base at batch 128 x 128, ResNet-50 at batch 256
and 224 pixels): parameter-sized storages by the parameter count, activations by their own factor (batch x
width; x layers for what the encoder layers save; vocabulary-sized ones by the batch alone) -- the scaled
peak is the largest scaled total over the step's timeline.  A model, not a measurement: the GPU's numbers
come from ``mptrain bench e2e --models user_resnet50,user_bert`` (caching allocator, cuDNN/flash kernels).

    python dev/memory_accounting.py                        # both models, the three modes
    python dev/memory_accounting.py --model bert --modes mptrain:bf16-master,lightning:bf16-mixed
    python dev/memory_accounting.py --autocast-lists cpu   # CPU autocast's own lists
    python dev/memory_accounting.py --json out.json
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import sys
import weakref
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional

import lightning as L
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map_only

from mptrain.precision import lean_cross_entropy

FULL_BLOCK_ELEMENTS = lean_cross_entropy.BLOCK_ELEMENTS

HALF = (torch.float16, torch.bfloat16)
MODES = ("mptrain:bf16-master", "lightning:bf16-mixed", "lightning:bf16-true")
#: CUDA autocast's fp32 ops that CPU autocast leaves in the input's dtype (aten names)
CUDA_ONLY_FP32 = ("layer_norm", "group_norm", "rms_norm", "softmax.int", "log_softmax.int", "logsumexp")
GB = 2**30
#: ops whose output is a copy of their first argument (an autocast weight cast is one)
COPIES = ("_to_copy", "clone", "to", "contiguous")

# -- the models and what they scale to ------------------------------------------------------------------------------
#: the measured size ("small", CPU) and the GPU benchmark's ("full")
BERT = {"small": dict(batch=8, seq=128, config=dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                                                    intermediate_size=1024, vocab_size=30522)),
        "full": dict(batch=128, seq=128, config={})}
RESNET = {"small": dict(batch=8, size=64), "full": dict(batch=256, size=224)}


@dataclass
class Scale:
    """Factors from the measured model to the benchmark's: parameter-sized storages, activations (per tensor),
    and the layer count for what the repeated blocks save."""
    params: float
    act: Callable[[tuple], float]  # birth shape -> factor
    layers: float = 1.0
    layer_marker: str = ""  # a module path holding this is inside a repeated block


def bert_case(size: str, device: str):
    """The user BERT; on the CPU without attention dropout (CPU SDPA takes its fp32 math path with dropout,
    where CUDA runs flash attention with it, saving the same tensors as CPU flash attention without)."""
    from mptrain.bench.e2e_models import mlm_batches
    from mptrain.bench.user_models import UserBert

    spec, full = BERT[size], BERT["full"]
    config = dict(spec["config"], **({"attention_probs_dropout_prob": 0.0} if device == "cpu" else {}))
    module = UserBert(fused=device != "cpu", **config)
    with torch.device("meta"):
        base = UserBert(fused=False)
    vocab, small_cfg, base_cfg = module.model.config.vocab_size, module.model.config, base.model.config
    b = full["batch"] / spec["batch"]
    width = base_cfg.hidden_size / small_cfg.hidden_size
    # the fallback's block-wise cross_entropy holds one block of fp32 rows: a block of the full size's rows,
    # scaled like every vocabulary-sized tensor, is the measured size's block times the batch ratio
    lean_cross_entropy.BLOCK_ELEMENTS = int(FULL_BLOCK_ELEMENTS // b)
    scale = Scale(params=_count(base) / _count(module), act=lambda shape: b if vocab in shape else b * width,
                  layers=base_cfg.num_hidden_layers / small_cfg.num_hidden_layers, layer_marker=".layer.")
    return module, lambda steps: mlm_batches(spec["batch"], steps, device, spec["seq"], vocab), scale


def resnet_case(size: str, device: str):
    from mptrain.bench.e2e_models import image_batches
    from mptrain.bench.user_models import UserResNet

    spec, full = RESNET[size], RESNET["full"]
    module = UserResNet("resnet50", fused=device != "cpu")
    b, pixels = full["batch"] / spec["batch"], (full["size"] / spec["size"]) ** 2
    scale = Scale(params=1.0, act=lambda shape: b * pixels if len(shape) == 4 else b)
    return module, lambda steps: image_batches(spec["batch"], steps, device, spec["size"]), scale


CASES = {"bert": bert_case, "resnet": resnet_case}


def _count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


# -- CUDA autocast's fp32 list on the CPU -------------------------------------------------------------------------
@contextlib.contextmanager
def cuda_autocast_lists():
    """AutocastCPU kernels that run CUDA_ONLY_FP32 in fp32 as AutocastCUDA does: half args cast up (a
    differentiable cast that saves nothing), the op with autocast off, its fp32 result returned."""
    lib = torch.library.Library("aten", "IMPL")

    def fp32(op):
        def kernel(*args, **kwargs):
            with torch._C._DisableAutocast():
                args, kwargs = tree_map_only(torch.Tensor, lambda t: t.float() if t.dtype in HALF else t,
                                             (args, kwargs))
                return op(*args, **kwargs)
        return kernel

    for name in CUDA_ONLY_FP32:
        packet, _, overload = name.partition(".")
        lib.impl(name, fp32(getattr(getattr(torch.ops.aten, packet), overload or "default")), "AutocastCPU")
    try:
        yield
    finally:
        lib._destroy()


# -- storages from birth to death ----------------------------------------------------------------------------------
@dataclass
class Birth:
    nbytes: int
    shape: tuple
    dtype: str
    op: str
    module: str
    phase: str
    src: Optional[int] = None  # the storage a cast/copy was made from
    token: int = 0


class Storages(TorchDispatchMode):
    """Every storage an op returns, from its first sight to its finalizer: ``live`` (data pointer -> Birth),
    ``bytes`` (their sum); ``on_op(name)`` after each op."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, Birth] = {}
        self.bytes = 0
        self.phase, self.module = "setup", ""
        self.on_op: Optional[Callable[[str], None]] = None
        self.last_op = "?"
        self._tokens = itertools.count(1)

    def adopt(self, tensors, op: str = "(before tracking)") -> None:
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self._see(t, op, None)

    def _see(self, t: torch.Tensor, op: str, src: Optional[int]) -> None:
        if t.device.type == "meta":
            return
        st = t.untyped_storage()
        key, n = st.data_ptr(), st.nbytes()
        if n == 0 or key in self.live:
            return
        token = next(self._tokens)
        self.live[key] = Birth(n, tuple(t.shape), str(t.dtype).removeprefix("torch."), op, self.module, self.phase,
                               src, token)
        self.bytes += n
        weakref.finalize(st, self._free, key, token)

    def _free(self, key: int, token: int) -> None:
        b = self.live.get(key)
        if b is not None and b.token == token:
            del self.live[key]
            self.bytes -= b.nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        first = args[0] if args and name in COPIES else None
        src = key_of(first) if isinstance(first, torch.Tensor) and first.device.type != "meta" else None
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._see(t, name, src)
        self.last_op = name
        if self.on_op is not None:
            self.on_op(name)
        return out


def key_of(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


# -- roles ------------------------------------------------------------------------------------------------------
ROLES = ("param", "buffer", "grad", "master", "master grad", "optimizer state", "fp32 init", "saved weight copy",
         "saved activation", "batch", "other")


def roles_of(trainer, module: torch.nn.Module, saved: dict[int, Any], batch_keys: set[int],
             storages: Storages) -> dict[int, str]:
    """Each live storage's role, the first that applies in ROLES order."""
    roles: dict[int, str] = {}

    def mark(t, role):
        if isinstance(t, torch.Tensor) and t.device.type != "meta" and t.untyped_storage().nbytes():
            roles.setdefault(key_of(t), role)

    params = list(module.parameters())
    for p in params:
        mark(p, "param")
    for b in module.buffers():
        mark(b, "buffer")
    ids = {id(p) for p in params}
    opt_params = [p for opt in trainer.optimizers for g in opt.param_groups for p in g["params"]]
    for p in opt_params:
        if id(p) not in ids:
            mark(p, "master")
    for p in params:
        mark(p.grad, "grad")
    for p in opt_params:
        if id(p) not in ids:
            mark(p.grad, "master grad")
    for opt in trainer.optimizers:
        for st in opt.state.values():
            for v in st.values():
                mark(v, "optimizer state")
    for t in getattr(trainer.precision_plugin, "_fp32_init", {}).values():
        mark(t, "fp32 init")
    param_keys = {k for k, r in roles.items() if r in ("param", "master")}
    for k, kind in saved.items():
        if k in storages.live and storages.live[k].token == kind[-1] and k not in roles:  # not a reused address
            roles[k] = "saved weight copy" if storages.live[k].src in param_keys else "saved activation"
    for k in batch_keys:
        roles.setdefault(k, "batch")
    return roles


# -- one mode's measured step -----------------------------------------------------------------------------------
@dataclass
class Snapshot:
    phase: str
    op: str
    module: str
    bytes: int
    by_role: dict[str, int]
    scaled: float = 0.0
    scaled_by_role: dict[str, float] = field(default_factory=dict)
    others: list = field(default_factory=list)  # the largest "other" storages (at a phase's peak)


@dataclass
class Report:
    mode: str
    params: int
    saved_total: int = 0
    saved_beyond_params: int = 0
    saved_by_kind: list = field(default_factory=list)  # (module type, op, dtype, bytes, count)
    saved_scaled: float = 0.0
    after_step: dict[str, int] = field(default_factory=dict)
    after_step_scaled: dict[str, float] = field(default_factory=dict)
    peaks: dict[str, dict] = field(default_factory=dict)  # phase -> Snapshot as dict
    scaled_peak: dict = field(default_factory=dict)
    other_after_step: list = field(default_factory=list)
    cuda_peak: Optional[int] = None  # torch.cuda.max_memory_allocated() of the whole fit (--device cuda)


class Accounting(L.Callback):
    """Drives the measurement in step ``measure``: phases, saved-tensor hooks, module names, snapshots."""

    def __init__(self, storages: Storages, measure: int, scale: Scale, batch_keys: set[int]):
        self.storages, self.measure, self.scale, self.batch_keys = storages, measure, scale, batch_keys
        self.saved: dict[int, tuple] = {}  # storage -> (module type, op, dtype) of its pack
        self.timeline: list[Snapshot] = []
        self.report: Optional[Report] = None
        self._hooks = self._module_hooks = None
        self._stack: list[str] = []
        self._names: dict[int, tuple[str, str]] = {}
        self._trainer = self._module = None

    # phases
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx != self.measure:
            return
        self._trainer, self._module = trainer, pl_module
        self._names = {id(m): (name, type(m).__name__) for name, m in pl_module.named_modules()}
        self._by_name = dict(pl_module.named_modules())
        self._module_hooks = (torch.nn.modules.module.register_module_forward_pre_hook(self._enter),
                              torch.nn.modules.module.register_module_forward_hook(self._exit, always_call=True))
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        self.storages.phase = "forward"
        self.storages.on_op = self._snapshot

    def on_before_backward(self, trainer, pl_module, loss):
        if self._hooks is None:
            return
        self._hooks.__exit__(None, None, None)
        self._hooks = None
        for h in self._module_hooks:
            h.remove()
        self._record_saved()
        self.storages.phase, self.storages.module = "backward", ""

    def on_after_backward(self, trainer, pl_module):
        if self.storages.phase == "backward":
            self.storages.phase = "optimizer"

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx != self.measure:
            return
        self.storages.phase = "after step"
        self._snapshot("(end of step)")
        self.storages.on_op = None
        self._finish()

    # hooks
    def _enter(self, module, args):
        self._stack.append(self._names.get(id(module), ("?", type(module).__name__))[0])
        self.storages.module = self._stack[-1]

    def _exit(self, module, args, out):
        if self._stack:
            self._stack.pop()
        self.storages.module = self._stack[-1] if self._stack else ""

    def _pack(self, t: torch.Tensor):
        if t.device.type != "meta" and t.untyped_storage().nbytes():
            mod = self._by_name.get(self._stack[-1]) if self._stack else None
            mod_type = type(mod).__name__ if mod is not None else "-"
            birth = self.storages.live.get(key_of(t))
            self.saved.setdefault(key_of(t), (mod_type, self.storages.last_op, str(t.dtype)[6:],
                                              birth.token if birth is not None else -1))
        return t

    # measurements
    def _roles(self) -> dict[int, str]:
        return roles_of(self._trainer, self._module, self.saved, self.batch_keys, self.storages)

    def _factor(self, key: int, role: str) -> float:
        b = self.storages.live[key]
        if role in ("param", "buffer", "grad", "master", "master grad", "optimizer state", "fp32 init",
                    "saved weight copy") or b.phase in ("setup", "optimizer", "after step"):
            return self.scale.params
        f = self.scale.act(b.shape)
        if role == "saved activation" and self.scale.layer_marker and self.scale.layer_marker in b.module:
            f *= self.scale.layers
        return f

    def _snapshot(self, op: str) -> None:
        roles = self._roles()
        by_role: dict[str, int] = defaultdict(int)
        scaled: dict[str, float] = defaultdict(float)
        for key, b in self.storages.live.items():
            role = roles.get(key, "other")
            by_role[role] += b.nbytes
            scaled[role] += b.nbytes * self._factor(key, role)
        snap = Snapshot(self.storages.phase, op, self.storages.module, self.storages.bytes, dict(by_role),
                        sum(scaled.values()), dict(scaled))
        phase_max = max((s.bytes for s in self.timeline if s.phase == snap.phase), default=-1)
        if snap.bytes > phase_max:  # a new peak of its phase: what the "other" storages are
            others = sorted((b for k, b in self.storages.live.items() if roles.get(k, "other") == "other"),
                            key=lambda b: -b.nbytes)[:4]
            snap.others = [f"{b.nbytes / 2**20:.1f} MB {b.dtype} {list(b.shape)} from {b.op} in {b.phase} "
                           f"({b.module or '-'})" for b in others]
        self.timeline.append(snap)

    def _record_saved(self) -> None:
        roles = self._roles()
        live = {k: v[:3] for k, v in self.saved.items()
                if k in self.storages.live and self.storages.live[k].token == v[-1]}
        kinds: dict[tuple, list] = defaultdict(lambda: [0, 0])
        total = beyond = 0
        scaled = 0.0
        for k, kind in live.items():
            n = self.storages.live[k].nbytes
            total += n
            if roles.get(k) not in ("param", "buffer", "master"):
                beyond += n
                kinds[kind][0] += n
                kinds[kind][1] += 1
                scaled += n * self._factor(k, roles.get(k, "saved activation"))
        self._saved_summary = (total, beyond, sorted(((*k, v[0], v[1]) for k, v in kinds.items()),
                                                     key=lambda r: -r[3]), scaled)

    def _finish(self) -> None:
        roles = self._roles()
        after: dict[str, int] = defaultdict(int)
        after_scaled: dict[str, float] = defaultdict(float)
        others = []
        for key, b in self.storages.live.items():
            role = roles.get(key, "other")
            after[role] += b.nbytes
            after_scaled[role] += b.nbytes * self._factor(key, role)
            if role == "other" and b.nbytes >= 1 << 16:
                others.append((b.nbytes, b.shape, b.dtype, b.op, b.phase, b.module))
        total, beyond, kinds, saved_scaled = self._saved_summary
        rep = Report(mode="", params=_count(self._module), saved_total=total, saved_beyond_params=beyond,
                     saved_by_kind=kinds, saved_scaled=saved_scaled, after_step=dict(after),
                     after_step_scaled=dict(after_scaled), other_after_step=sorted(others, reverse=True)[:10])
        for phase in ("forward", "backward", "optimizer"):
            snaps = [s for s in self.timeline if s.phase == phase]
            if snaps:
                rep.peaks[phase] = asdict(max(snaps, key=lambda s: s.bytes))
        if self.timeline:
            rep.scaled_peak = asdict(max(self.timeline, key=lambda s: s.scaled))
        self.report = rep


def run_mode(mode: str, model: str, steps: int, autocast_lists: str, size: str = "small",
             device: str = "cpu") -> Report:
    kind, precision = mode.split(":")
    torch.manual_seed(0)
    storages = Storages()
    module, make_batches, scale = CASES[model](size, device)
    module = module.to(device)
    loader = make_batches(steps)  # distinct batches made once, cycled
    batches = loader.batches
    batch_keys = {key_of(t) for b in batches for t in tree_flatten(b)[0] if isinstance(t, torch.Tensor)}
    acc = Accounting(storages, steps - 1, scale, batch_keys)
    common = dict(max_steps=steps, max_epochs=1, logger=False, enable_progress_bar=False, enable_checkpointing=False,
                  enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, callbacks=[acc],
                  accelerator=device, devices=1, precision=precision)
    if kind == "mptrain":
        from mptrain import Trainer

        trainer = Trainer(**common)
    else:
        trainer = L.Trainer(**common)
    lists = cuda_autocast_lists() if autocast_lists == "cuda" and device == "cpu" else contextlib.nullcontext()
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    with lists, storages:
        storages.adopt(list(module.parameters()) + list(module.buffers()))
        storages.adopt(t for b in batches for t in tree_flatten(b)[0])
        trainer.fit(module, train_dataloaders=loader)
    if acc.report is None:
        raise RuntimeError(f"{mode}: the measured step {steps - 1} did not run")
    acc.report.mode = mode
    if device == "cuda":
        acc.report.cuda_peak = torch.cuda.max_memory_allocated()
    return acc.report


# -- printing -----------------------------------------------------------------------------------------------------
def _mb(n: float) -> str:
    return f"{n / 2**20:9.1f}"


def _gb(n: float) -> str:
    return f"{n / GB:7.2f}"


def print_report(model: str, reports: list[Report]) -> None:
    print(f"\n=== {model}: {reports[0].params / 1e6:.2f} M parameters measured; scaled figures are the GPU "
          f"benchmark's size (GB)")
    print("\n(a) saved for backward at the end of the forward (unique storages)")
    print(f"{'mode':<22} {'total MB':>9} {'beyond params MB':>17} {'scaled GB':>9}")
    for r in reports:
        print(f"{r.mode:<22} {_mb(r.saved_total)} {_mb(r.saved_beyond_params):>17} {_gb(r.saved_scaled):>9}")
    for r in reports:
        print(f"  {r.mode}: by module type / op / dtype (MB, tensors)")
        for mod, op, dtype, n, count in r.saved_by_kind[:12]:
            print(f"    {mod:<24} {op:<44} {dtype:<9} {_mb(n)} {count:5d}")
    print("\n(b) live after the optimizer step, by role: MB (bytes/param) | scaled GB")
    head = f"{'role':<18}" + "".join(f" {r.mode:>32}" for r in reports)
    print(head)
    for role in ROLES:
        if not any(role in r.after_step for r in reports):
            continue
        cells = [f"{_mb(r.after_step.get(role, 0))} ({r.after_step.get(role, 0) / r.params:4.1f}) |"
                 f"{_gb(r.after_step_scaled.get(role, 0))}" for r in reports]
        print(f"{role:<18}" + "".join(f" {c:>32}" for c in cells))
    for r in reports:
        for n, shape, dtype, op, phase, module in r.other_after_step[:5]:
            print(f"  {r.mode}: other after step: {_mb(n)} MB {dtype} {list(shape)} from {op} in {phase} {module}")
    print("\n(c) peaks of the measured step: live MB by role (the op at the peak)")
    for r in reports:
        for phase, s in r.peaks.items():
            roles = ", ".join(f"{k} {v / 2**20:.1f}" for k, v in sorted(s["by_role"].items(), key=lambda kv: -kv[1]))
            print(f"  {r.mode:<22} {phase:<9} {_mb(s['bytes'])} at {s['op']} ({s['module'] or '-'}): {roles}")
            for o in s["others"]:
                print(f"      other: {o}")
    print("\nscaled peak (GB): the largest scaled total of the step, where, and by role")
    for r in reports:
        s = r.scaled_peak
        roles = ", ".join(f"{k} {v / GB:.2f}" for k, v in sorted(s["scaled_by_role"].items(), key=lambda kv: -kv[1])
                          if v >= 0.005 * GB)
        print(f"  {r.mode:<22} {_gb(s['scaled'])} in {s['phase']} at {s['op']} ({s['module'] or '-'}): {roles}")
    for r in reports:
        if r.cuda_peak is not None:
            print(f"  {r.mode:<22} torch.cuda.max_memory_allocated() over the fit: {_gb(r.cuda_peak)} GB")


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="bert,resnet", help="comma list of: " + ", ".join(CASES))
    p.add_argument("--modes", default=",".join(MODES), help="comma list of trainer:precision, e.g. " + MODES[0])
    p.add_argument("--steps", type=int, default=3, help="steps per mode; the last one is measured")
    p.add_argument("--autocast-lists", choices=("cuda", "cpu"), default="cuda",
                   help="which autocast fp32 op list the CPU runs (default: CUDA's)")
    p.add_argument("--size", choices=tuple(BERT), default="small",
                   help="small: the CPU-sized models (scaled figures model the GPU benchmark); full: the benchmark's")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: CUDA's own autocast, and torch.cuda.max_memory_allocated() beside the accounting")
    p.add_argument("--json", default=None, help="also write the reports here")
    args = p.parse_args(argv)
    if args.steps < 2:
        p.error("--steps must be >= 2: the measured step needs the optimizer state of a step before it")
    out = {}
    for model in args.model.split(","):
        reports = [run_mode(mode, model, args.steps, args.autocast_lists, args.size, args.device)
                   for mode in args.modes.split(",")]
        print_report(model, reports)
        out[model] = [asdict(r) for r in reports]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
