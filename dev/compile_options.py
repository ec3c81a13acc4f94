"""Lab: options for the compiled e2e cases (not shipped): does a tuning option of torch.compile,
or cuDNN trying every convolution algorithm, make mptrain's best ResNet-50 / BERT step faster,
and Lightning + compile's?

    python3 dev/compile_options.py [--model resnet50] [--variants default,cdt,cudnn-all,multi-kernel,combo] [--repeat 2]
        [--case mptrain+compile+cuda_graphs:best] [--precision 16-master] [--warmup 6 --steps 20]

Each (variant, round) runs in a fresh process (dynamo's and inductor's in-memory caches do not
carry a variant into the next), through `mptrain.bench.e2e.run_case`, with the variant's inductor
``options`` given to torch.compile (``cudnn-all``: none; ``torch.backends.cudnn.benchmark_limit = 0``
instead); variants alternate so that drift favours none.  Prints img/s (or seq/s), ms/step, GPU
ms/step and the process's wall time (compile included).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

#: name -> inductor options; "cudnn-all" leaves inductor alone and lets cuDNN's benchmark try every
#: convolution algorithm (torch.backends.cudnn.benchmark_limit = 0; torch's default tries 10).
#: multi-kernel: each reduction compiled both persistent and looped, the faster picked at run time;
#: combo: independent kernels launched as one (horizontal fusion).  Sessions 16-17: docs/PERFORMANCE.md.
VARIANTS = {
    "default": {},
    "cdt": {"coordinate_descent_tuning": True},
    "cudnn-all": {},
    "multi-kernel": {"triton.multi_kernel": 1},
    "combo": {"combo_kernels": True},
}


def child(model: str, case: str, precision: str, variant: str, warmup: int, steps: int) -> dict:
    import torch

    from mptrain.bench import e2e, e2e_models

    options = VARIANTS[variant]
    if variant == "cudnn-all":
        torch.backends.cudnn.benchmark_limit = 0
    if options:
        if case.startswith("lightning"):
            plain = e2e_models.compile_lightning_module
            e2e.compile_lightning_module = lambda m, **kw: plain(m, **{**kw, "options": options})
        else:
            plain_trainer = e2e.make_trainer

            def make_trainer(kind, prec, callback, max_steps, ours, **kw):
                if ours.get("compile"):
                    ours = {**ours, "compile": {"options": options}}
                return plain_trainer(kind, prec, callback, max_steps, ours, **kw)

            e2e.make_trainer = make_trainer
    spec = e2e.CASES[case]
    if spec.precision == "best":  # run_case takes the precision it is given
        e2e.CASES[case] = e2e.CaseSpec(spec.trainer, precision, spec.optimizer, spec.compile, spec.cuda_graphs)
    r = e2e.run_case(model, case, precision, warmup, steps, quick=False)
    return {"status": r.status, "rate": r.samples_per_s, "ms": r.step_ms, "gpu_ms": r.gpu_step_ms,
            "message": (r.message or "")[:400]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="resnet50")
    p.add_argument("--case", default="mptrain+compile+cuda_graphs:best")
    p.add_argument("--precision", default="16-master")
    p.add_argument("--variants", default="default,cdt")
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--warmup", type=int, default=6)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        print("RESULT " + json.dumps(child(a.model, a.case, a.precision, a.child, a.warmup, a.steps)))
        return 0
    names = [v for v in a.variants.split(",") if v]
    bad = [v for v in names if v not in VARIANTS]
    if bad:
        p.error(f"--variants: {', '.join(bad)} unknown; choose from {', '.join(VARIANTS)}")
    for r in range(a.repeat):
        for name in (names if r % 2 == 0 else names[::-1]):
            t = time.perf_counter()
            cmd = [sys.executable, __file__, "--child", name, "--model", a.model, "--case", a.case, "--precision",
                   a.precision, "--warmup", str(a.warmup), "--steps", str(a.steps)]
            out = subprocess.run(cmd, capture_output=True, text=True)
            wall = time.perf_counter() - t
            lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
            if out.returncode or not lines:
                print(f"{a.case} {name}: rc={out.returncode}\n{out.stderr[-3000:]}", flush=True)
                continue
            res = json.loads(lines[-1][7:])
            if res["status"] != "ok":
                print(f"{a.case} {name}: {res['status']} {res['message']}", flush=True)
                continue
            print(f"{a.model} {a.case} @{a.precision} [{name}] round {r}: {res['rate']:.1f}/s  {res['ms']:.2f} ms/step  "
                  f"gpu {res['gpu_ms']:.2f} ms/step  process {wall:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
