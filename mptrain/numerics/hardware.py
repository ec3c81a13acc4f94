"""`mptrain doctor`: what this machine can do for mixed precision, and what to use.

Reports the GPUs (name, compute capability, memory, SMs), which tensor-core paths they
have (TF32, FP16, BF16, INT8, FP8, from the capability and, with a GPU, a tiny probe of
the op itself), the driver / CUDA / torch / nvcc / ninja versions, whether mptrain's CUDA
extension builds and loads, and a one-line recommendation.  Everything degrades to
"not available (why)" instead of raising: the doctor must run on a broken machine.
"""
from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
from typing import Any, Optional

import torch

# Minimum compute capability of each tensor-core path (NVIDIA).
TENSOR_CORE_MIN_CC = {
    "fp16": (7, 0),  # Volta
    "int8": (7, 5),  # Turing IMMA (torch._int_mm / cuBLASLt)
    "tf32": (8, 0),  # Ampere
    "bf16": (8, 0),  # Ampere
    "fp8": (8, 9),  # Ada / Hopper (torch._scaled_mm)
}


def _run(cmd: list[str], timeout: float = 10.0) -> Optional[str]:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _nvcc_path() -> Optional[str]:
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home and os.path.exists(os.path.join(home, "bin", "nvcc")):
        return os.path.join(home, "bin", "nvcc")
    found = shutil.which("nvcc")
    if found:
        return found
    return "/usr/local/cuda/bin/nvcc" if os.path.exists("/usr/local/cuda/bin/nvcc") else None


def tool_versions() -> dict:
    """torch, CUDA runtime of torch, cuDNN, driver, nvcc, ninja, python."""
    v: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                         "torch_cuda": torch.version.cuda, "cudnn": None, "driver": None, "nvcc": None, "ninja": None}
    try:
        v["cudnn"] = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    except Exception:  # noqa: BLE001 - a broken cuDNN install is reported, not raised
        v["cudnn"] = None
    smi = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    if smi:
        v["driver"] = smi.splitlines()[0].strip()
    nvcc = _nvcc_path()
    if nvcc:
        out = _run([nvcc, "--version"])
        m = re.search(r"release ([\d.]+)", out or "")
        v["nvcc"] = f"{m.group(1)} ({nvcc})" if m else f"unknown ({nvcc})"
    ninja = shutil.which("ninja")
    if ninja:
        v["ninja"] = _run([ninja, "--version"]) or "unknown"
    else:
        try:  # the pip package ships the binary
            import ninja as _ninja  # noqa: F401

            v["ninja"] = f"{getattr(_ninja, '__version__', 'installed')} (pip package)"
        except ImportError:
            v["ninja"] = None
    return v


def _probe(fn) -> tuple[bool, str]:
    try:
        fn()
        torch.cuda.synchronize()
        return True, "ok"
    except Exception as e:  # noqa: BLE001 - any failure means "this path does not work here"
        return False, f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"


def _probes(dev: int) -> dict:
    """Run each tensor-core op once on tiny operands of the right shape."""
    d = torch.device("cuda", dev)
    a32 = torch.randn(32, 32, device=d)
    res = {}
    res["fp16"] = _probe(lambda: a32.half() @ a32.half())
    res["bf16"] = _probe(lambda: a32.bfloat16() @ a32.bfloat16())
    res["tf32"] = _probe(lambda: a32 @ a32)  # always runs; whether it uses TF32 depends on the capability
    if hasattr(torch, "_int_mm"):
        ai = torch.randint(-8, 8, (32, 32), device=d, dtype=torch.int8)
        res["int8"] = _probe(lambda: torch._int_mm(ai, ai.t().contiguous().t()))
    else:
        res["int8"] = (False, "torch has no _int_mm")
    if hasattr(torch, "_scaled_mm") and hasattr(torch, "float8_e4m3fn"):
        f8 = a32.to(torch.float8_e4m3fn)
        one = torch.ones((), device=d)
        res["fp8"] = _probe(lambda: torch._scaled_mm(f8, f8.t().contiguous().t(), scale_a=one, scale_b=one,
                                                     out_dtype=torch.bfloat16))
    else:
        res["fp8"] = (False, "torch has no _scaled_mm / float8")
    return res


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
                info["probes"] = {k: {"ok": ok, "detail": why} for k, (ok, why) in _probes(i).items()}
        gpus.append(info)
    return gpus


def extension_info(build: bool) -> dict:
    """Status of mptrain's CUDA extension (mptrain.ops.build), built only when ``build``."""
    try:
        from mptrain.ops import build as ext_build
    except ImportError as e:
        return {"available": False, "status": f"mptrain.ops.build not importable: {e}", "build": "not attempted"}
    info: dict[str, Any] = {"available": None, "status": None}
    status_fn = getattr(ext_build, "extension_status", None)
    if status_fn is not None:
        try:
            info["status"] = _plain(status_fn())
        except Exception as e:  # noqa: BLE001
            info["status"] = f"extension_status() failed: {type(e).__name__}: {e}"
    if build:
        get = getattr(ext_build, "get_extension", None)
        if get is None:
            info["available"] = False
            info["build"] = "mptrain.ops.build has no get_extension()"
        else:
            try:
                ext = get(required=False)
                info["available"] = ext is not None
                info["build"] = "built and loaded" if ext is not None else "not loaded (see status)"
                if status_fn is not None:
                    info["status"] = _plain(status_fn())
            except Exception as e:  # noqa: BLE001 - the doctor reports why, it does not crash
                info["available"] = False
                info["build"] = f"build failed: {type(e).__name__}: {str(e)[:500]}"
    else:
        info["build"] = "not attempted (no GPU, or --no-build; `mptrain doctor --build` tries anyway)"
    return info


def _plain(obj: Any) -> Any:
    if hasattr(obj, "describe"):  # mptrain.ops.build.ExtensionStatus: state plus reason / log path
        return obj.describe()
    if isinstance(obj, (str, int, float, bool)) or obj is None:
        return obj
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    return str(obj)


def recommend(gpus: list[dict]) -> str:
    """One line: which precision to train with here."""
    if not gpus:
        cpu_bf16 = _cpu_has_bf16()
        extra = " ('bf16-mixed' is worth trying: this CPU has native bf16)" if cpu_bf16 else ""
        return f"No CUDA GPU: train on the CPU path with precision='32-true'{extra}; fused kernels are GPU-only."
    g = gpus[0]
    tc = g["tensor_cores"]
    probes = g.get("probes") or {}
    bf16_ok = tc["bf16"] and probes.get("bf16", {}).get("ok", True)
    if bf16_ok:
        fp8 = " FP8 tensor cores are present (benchmark with `mptrain bench gemm`)." if tc["fp8"] else ""
        return (f"{g['name']} (sm_{g['capability'].replace('.', '')}): use precision='bf16-master' "
                f"(bf16 has fp32's range: no loss scaling needed); TF32 for the fp32 parts.{fp8}")
    if tc["fp16"]:
        return (f"{g['name']} (sm_{g['capability'].replace('.', '')}) has no bf16: use precision='16-master' with the "
                f"dynamic loss scaler, and check `mptrain numerics` for overflowing layers.")
    return f"{g['name']} has no tensor cores for half precision: use precision='32-true'."


def _cpu_has_bf16() -> bool:
    try:
        cap = torch.backends.cpu.get_cpu_capability()
    except AttributeError:
        return False
    return "AVX512" in cap.upper() and _cpu_flag("avx512_bf16") or _cpu_flag("amx_bf16")


def _cpu_flag(flag: str) -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return flag in f.read()
    except OSError:
        return False


def doctor_report(build_extension: Optional[bool] = None, probe: bool = True) -> dict:
    """Everything `mptrain doctor` prints, as a dict (JSON-serializable).

    ``build_extension``: try to build/load the CUDA extension (default: only with a GPU,
    since the build needs one to be useful and can take minutes the first time).
    """
    gpus = gpu_info(probe=probe)
    if build_extension is None:
        build_extension = bool(gpus)
    try:
        cpu_cap = torch.backends.cpu.get_cpu_capability()
    except AttributeError:
        cpu_cap = None
    return {
        "versions": tool_versions(),
        "cuda_available": torch.cuda.is_available(),
        "gpus": gpus,
        "cpu": {"machine": platform.machine(), "capability": cpu_cap, "threads": torch.get_num_threads(),
                "bf16_native": _cpu_has_bf16()},
        "matmul_precision": torch.get_float32_matmul_precision(),
        "extension": extension_info(build_extension),
        "recommendation": recommend(gpus),
    }


def format_doctor(r: dict) -> str:
    """The report as text."""
    v = r["versions"]
    lines = ["mptrain doctor", "=============="]
    lines.append(f"python {v['python']} | torch {v['torch']} (CUDA {v['torch_cuda'] or 'none'}, cuDNN {v['cudnn'] or 'none'})")
    lines.append(f"driver {v['driver'] or 'not found (no nvidia-smi)'} | nvcc {v['nvcc'] or 'not found'} | "
                 f"ninja {v['ninja'] or 'not found'}")
    c = r["cpu"]
    lines.append(f"CPU: {c['machine']}, {c['threads']} threads, vector ISA {c['capability']}, native bf16: "
                 f"{'yes' if c['bf16_native'] else 'no'}")
    if not r["gpus"]:
        lines.append("GPU: none visible (torch.cuda.is_available() is False)")
    for g in r["gpus"]:
        lines.append(f"GPU {g['index']}: {g['name']}, compute capability {g['capability']}, "
                     f"{g['memory_gb']} GiB, {g['sms']} SMs")
        for path in ("tf32", "fp16", "bf16", "int8", "fp8"):
            has = g["tensor_cores"][path]
            pr = g["probes"].get(path)
            probe = "" if pr is None else (" (probe ok)" if pr["ok"] else f" (probe failed: {pr['detail']})")
            need = ".".join(map(str, TENSOR_CORE_MIN_CC[path]))
            lines.append(f"  {path.upper():<5} tensor cores: {'yes' if has else 'no '} (needs sm >= {need}){probe}")
    lines.append(f"float32 matmul precision: {r['matmul_precision']}")
    e = r["extension"]
    state = {True: "loads", False: "NOT available", None: "unknown"}[e.get("available")]
    lines.append(f"mptrain CUDA extension: {state}; build: {e.get('build')}")
    if e.get("status") is not None:
        lines.append(f"  status: {e['status']}")
    lines.append(f"recommendation: {r['recommendation']}")
    return "\n".join(lines)
