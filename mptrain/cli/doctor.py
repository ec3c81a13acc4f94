"""`mptrain doctor`: what this machine can do for mixed precision, and what to use.

GPUs and their tensor-core paths (from the capability and a tiny probe), toolchain versions,
whether mptrain's CUDA extension builds and loads, and a recommendation.  Everything degrades
to "not available (why)" instead of raising: the doctor must run on a broken machine.  It imports
no benchmark: its probes are one tiny product per path, made here.
"""
from __future__ import annotations

import contextlib
import json
import platform
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any, Optional

import torch
from jsonargparse import ArgumentParser

from mptrain.compat import torch as compat
from mptrain.ops.build import extension_status, find_cuda_home, get_extension
from mptrain.precision.fallback import cpu_lacks_native_bf16

#: minimum compute capability of each tensor-core path (NVIDIA)
TENSOR_CORE_MIN_CC = {"tf32": (8, 0), "fp16": (7, 0), "bf16": (8, 0), "int8": (7, 5), "fp8": (8, 9)}


def _run(cmd: list[str], timeout: float = 10.0) -> Optional[str]:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def tool_versions() -> dict:
    """torch, CUDA runtime of torch, cuDNN, driver, nvcc, ninja, python."""
    v: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                         "torch_cuda": torch.version.cuda, "cudnn": None, "driver": None, "nvcc": None, "ninja": None}
    with contextlib.suppress(Exception):  # None without cuDNN; a broken cuDNN install is reported, not raised
        v["cudnn"] = torch.backends.cudnn.version()
    smi = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    if smi:
        v["driver"] = smi.splitlines()[0].strip()
    cuda_home = find_cuda_home()
    if cuda_home is not None:
        nvcc = str(cuda_home / "bin" / "nvcc")
        m = re.search(r"release ([\d.]+)", _run([nvcc, "--version"]) or "")
        v["nvcc"] = f"{m.group(1)} ({nvcc})" if m else f"unknown ({nvcc})"
    ninja = shutil.which("ninja")  # torch's cpp_extension runs the ninja on PATH
    if ninja:
        v["ninja"] = _run([ninja, "--version"]) or "unknown"
    return v


def _probe_product(path: str, n: int, device: torch.device) -> torch.Tensor:
    """One ``n`` x ``n`` product on the tensor-core ``path``: random operands (int8 and fp8 with the
    second operand column-major, the layout cuBLASLt's kernels take)."""
    if path == "int8":
        a, b = (torch.randint(-128, 128, (n, n), dtype=torch.int8, device=device) for _ in range(2))
        return compat.int_mm(a, b.t())
    if path == "fp8":
        a, b = (torch.randn(n, n, device=device).to(torch.float8_e4m3fn) for _ in range(2))
        one = torch.ones((), device=device)
        return compat.scaled_mm(a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    dtype = {"tf32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[path]
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    if path != "tf32":
        return a @ b
    prev = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        return a @ b
    finally:
        torch.set_float32_matmul_precision(prev)


def _probes(dev: int) -> dict:
    """Run each tensor-core product once on tiny operands."""
    device, probes = torch.device("cuda", dev), {}
    for path in TENSOR_CORE_MIN_CC:
        try:
            _probe_product(path, 32, device)
            torch.cuda.synchronize()
            probes[path] = {"ok": True, "detail": "ok"}
        except Exception as e:  # noqa: BLE001 - any failure means "this path does not work here"
            first = str(e).splitlines()[0][:120] if str(e) else ""
            probes[path] = {"ok": False, "detail": f"{type(e).__name__}: {first}"}
    return probes


def gpu_info(probe: bool = True) -> list[dict]:
    """One dict per visible CUDA device."""
    if not torch.cuda.is_available():
        return []
    gpus = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        cc = (p.major, p.minor)
        paths = {k: cc >= v for k, v in TENSOR_CORE_MIN_CC.items()}
        info = {"index": i, "name": p.name, "capability": f"{p.major}.{p.minor}",
                "memory_gb": round(p.total_memory / 2**30, 1), "sms": p.multi_processor_count,
                "tensor_cores": paths, "probes": {}}
        if probe:
            with torch.cuda.device(i):
                info["probes"] = _probes(i)
        gpus.append(info)
    return gpus


def extension_info(build: bool) -> dict:
    """Status of mptrain's CUDA extension (mptrain.ops.build), built only when ``build``."""
    info: dict[str, Any] = {"available": None,
                            "build": "not attempted (no GPU, or --build false; `mptrain doctor --build true` tries anyway)"}
    if build:
        try:
            ext = get_extension(required=False)
            info["available"] = ext is not None
            info["build"] = "built and loaded" if ext is not None else "not loaded (see status)"
        except Exception as e:  # noqa: BLE001 - the doctor reports why, it does not crash
            info["available"], info["build"] = False, f"build failed: {type(e).__name__}: {str(e)[:500]}"
    info["status"] = extension_status().describe()
    return info


def recommend(gpus: list[dict]) -> str:
    """One line: which precision to train with here."""
    if not gpus:
        extra = "" if cpu_lacks_native_bf16() else " ('bf16-mixed' is worth trying: this CPU has native bf16)"
        return f"No CUDA GPU: train on the CPU path with precision='32-true'{extra}; fused kernels are GPU-only."
    g, tc = gpus[0], gpus[0]["tensor_cores"]
    gpu = f"{g['name']} (sm_{g['capability'].replace('.', '')})"
    if tc["bf16"] and (g.get("probes") or {}).get("bf16", {}).get("ok", True):
        fp8 = " FP8 tensor cores are present (benchmark with `mptrain bench gemm`)." if tc["fp8"] else ""
        return (f"{gpu}: use precision='bf16-master' (bf16 has fp32's range: no loss scaling needed); "
                f"TF32 for the fp32 parts.{fp8}")
    if tc["fp16"]:
        return (f"{gpu} has no bf16: use precision='16-master' with the dynamic loss scaler, and check "
                "`mptrain numerics` for overflowing layers.")
    return f"{g['name']} has no tensor cores for half precision: use precision='32-true'."


def doctor_report(build_extension: Optional[bool] = None, probe: bool = True) -> dict:
    """Everything `mptrain doctor` prints, as a JSON-serializable dict.  ``build_extension``: build/load
    the CUDA extension (default: only with a GPU, where it is useful; the first build takes minutes)."""
    gpus = gpu_info(probe=probe)
    return {
        "versions": tool_versions(),
        "cuda_available": torch.cuda.is_available(),
        "gpus": gpus,
        "cpu": {"machine": platform.machine(), "capability": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads(),
                "bf16_native": not cpu_lacks_native_bf16()},
        "matmul_precision": torch.get_float32_matmul_precision(),
        "extension": extension_info(bool(gpus) if build_extension is None else build_extension),
        "recommendation": recommend(gpus),
    }


def format_doctor(r: dict) -> str:
    """The report as text."""
    v, c = r["versions"], r["cpu"]
    lines = ["mptrain doctor", "==============",
             f"python {v['python']} | torch {v['torch']} "
             f"(CUDA {v['torch_cuda'] or 'none'}, cuDNN {v['cudnn'] or 'none'})",
             f"driver {v['driver'] or 'not found (no nvidia-smi)'} | nvcc {v['nvcc'] or 'not found'} | "
             f"ninja {v['ninja'] or 'not found'}",
             f"CPU: {c['machine']}, {c['threads']} threads, vector ISA {c['capability']}, native bf16: "
             f"{'yes' if c['bf16_native'] else 'no'}"]
    if not r["gpus"]:
        lines.append("GPU: none visible (torch.cuda.is_available() is False)")
    for g in r["gpus"]:
        lines.append(f"GPU {g['index']}: {g['name']}, compute capability {g['capability']}, "
                     f"{g['memory_gb']} GiB, {g['sms']} SMs")
        for path in ("tf32", "fp16", "bf16", "int8", "fp8"):
            pr = g["probes"].get(path)
            probe = "" if pr is None else (" (probe ok)" if pr["ok"] else f" (probe failed: {pr['detail']})")
            need = ".".join(map(str, TENSOR_CORE_MIN_CC[path]))
            has = "yes" if g["tensor_cores"][path] else "no "
            lines.append(f"  {path.upper():<5} tensor cores: {has} (needs sm >= {need}){probe}")
    lines.append(f"float32 matmul precision: {r['matmul_precision']}")
    e = r["extension"]
    state = {True: "loads", False: "NOT available", None: "unknown"}[e.get("available")]
    lines.append(f"mptrain CUDA extension: {state}; build: {e.get('build')}")
    if e.get("status") is not None:
        lines.append(f"  status: {e['status']}")
    lines.append(f"recommendation: {r['recommendation']}")
    return "\n".join(lines)


def doctor_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="mptrain doctor", exit_on_error=False, allow_abbrev=False,
                            description="GPU, tensor-core paths, toolchain versions, extension status, advice.")
    parser.add_argument("--json", type=Optional[str], default=None, help="also write the report as JSON to this path")
    parser.add_argument("--build", type=Optional[bool], default=None,
                        help="build/load the CUDA extension: null = only when a GPU is visible, true = always, false = never")
    parser.add_argument("--probe", type=bool, default=True, help="run the tiny tensor-core probes on each GPU")
    return parser


def doctor_main(argv: Optional[list[str]] = None) -> int:
    cfg = doctor_parser().parse_args(argv)
    report = doctor_report(build_extension=cfg.build, probe=cfg.probe)
    print(format_doctor(report))
    if cfg.json:
        Path(cfg.json).write_text(json.dumps(report, indent=2))
        print(f"wrote {cfg.json}")
    return 0
