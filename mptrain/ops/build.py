"""Build and load the one CUDA extension made from ``csrc/`` (DESIGN §4).

``get_extension()`` compiles every ``csrc/*.cpp`` and ``*.cu`` with ``torch.utils.cpp_extension.load``
(ninja) the first time a kernel is needed, once per process, cached in ``~/.cache/mptrain/ext-<hash>``
(``MPTRAIN_BUILD_DIR`` replaces ``~/.cache/mptrain``); the hash covers the sources, torch, CUDA, archs
and flags, so a stale binary never loads. A build that has loaded once is imported directly by later
processes (no cpp_extension, no ninja: well under a second instead of ~3.6 s).

Environment: ``MPTRAIN_CSRC`` (the ``csrc/`` directory; default: the one beside the package, i.e. an
editable install), ``TORCH_CUDA_ARCH_LIST`` (e.g. ``"9.0"``; default: the visible GPUs' archs, else
9.0), ``CUDA_HOME`` (default: the toolkit of the ``nvcc`` on PATH, following wrapper scripts, or
``/usr/local/cuda``), ``MAX_JOBS`` (default: the CPUs this process may use),
``MPTRAIN_SMALL_KERNEL_ARGS=1`` (4 KB kernel arguments, drivers older than CUDA 12.1).

Flags: ``-O3``; the C++ standard is torch's. No ``--use_fast_math``: approximate division/sqrt and
flushed denormals would change the optimizers' m/v for tiny gradients (kernels call ``__expf``
where they want it). The extension links torch's own libcublas (:func:`cublas_ldflags`).

A failed build raises :class:`ExtensionBuildError` naming the failing source, the log and the likely
fix. Concurrent processes serialise on an ``flock`` that dies with its holder (:func:`build_lock`).
``python -m mptrain.ops.build`` builds (or checks the cache) and prints the time.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Iterator, Optional

import torch

EXT_NAME = "mptrain_ext"
_LOCK_NAME = "mptrain-build.lock"  # our flock; torch's FileBaton uses "lock"
_SOURCE_SUFFIXES = (".cpp", ".cu", ".cuh", ".h")


class ExtensionBuildError(RuntimeError):
    """The extension could not be built or loaded; says which file, where the log is, what to do."""

    def __init__(self, message: str, failing_file: Optional[str] = None, log_path: Optional[str] = None,
                 fix: Optional[str] = None):
        details = (("failing file", failing_file), ("compiler output", log_path), ("likely fix", fix))
        super().__init__("\n  ".join([message] + [f"{label}: {value}" for label, value in details if value]))
        self.failing_file, self.log_path, self.fix = failing_file, log_path, fix


class ExtensionStatus(str):
    """``"built"``, ``"failed"`` or ``"not attempted"``, comparing equal to those strings; ``reason``,
    ``log_path``, ``build_dir`` and ``seconds`` carry the details, all in one line via :meth:`describe`."""

    reason: str
    log_path: Optional[str]
    build_dir: Optional[str]
    seconds: Optional[float]

    def __new__(cls, state: str, reason: str = "", log_path: Optional[str] = None,
                build_dir: Optional[str] = None, seconds: Optional[float] = None):
        self = super().__new__(cls, state)
        self.reason, self.log_path, self.build_dir, self.seconds = reason, log_path, build_dir, seconds
        return self

    def describe(self) -> str:
        seconds = "" if self.seconds is None else f" in {self.seconds:.1f} s"
        where = f" ({self.build_dir})" if self.build_dir else ""
        return str.__str__(self) + seconds + where + (f": {self.reason}" if self.reason else "")


_lock = threading.Lock()
_module = None
_status = ExtensionStatus("not attempted")
_error: Optional[ExtensionBuildError] = None
_warned = False


def extension_status() -> ExtensionStatus:
    """Whether this process built/loaded the extension, failed (and why), or has not tried."""
    return _status


def get_extension(required: bool = False):
    """The loaded extension module, building it on first use (at most once per process). A failed build returns ``None``
    with ``required=False`` (``fused="auto"``: the caller falls back to the reference; the first fallback in the process
    warns with the reason) and raises :class:`ExtensionBuildError` with ``required=True`` (``fused=True``)."""
    global _module, _status, _error, _warned
    with _lock:
        if _module is None and _error is None:
            t0 = time.perf_counter()
            try:
                _module, build_dir = build()
                _status = ExtensionStatus("built", build_dir=build_dir, seconds=time.perf_counter() - t0)
            except Exception as e:  # noqa: BLE001 - any failure means "use the reference", with the reason kept
                _error = e if isinstance(e, ExtensionBuildError) else ExtensionBuildError(
                    f"building the mptrain CUDA extension failed: {type(e).__name__}: {e}")
                _status = ExtensionStatus("failed", reason=str(_error), log_path=_error.log_path)
    if _module is None:
        if required:
            raise _error  # type: ignore[misc]
        if not _warned:  # one warning per process, whichever op asked first
            _warned = True
            warnings.warn(f"mptrain: fused CUDA kernels unavailable, using the PyTorch reference instead. {_error}",
                          RuntimeWarning, stacklevel=2)
    return _module


# Where things are
def csrc_dir() -> Path:
    """``$MPTRAIN_CSRC`` or the repository's ``csrc/`` next to the ``mptrain`` package."""
    env = os.environ.get("MPTRAIN_CSRC")
    path = Path(env) if env else Path(__file__).resolve().parents[2] / "csrc"
    if not (path / f"{EXT_NAME}.cpp").is_file():
        raise ExtensionBuildError(f"csrc directory not found: {path} has no {EXT_NAME}.cpp",
                                  fix="install mptrain from its repository with `pip install -e .` (a wheel does "
                                      "not ship csrc/), or set MPTRAIN_CSRC to the csrc directory")
    return path


def sources(csrc: Path) -> list[Path]:
    """The translation units: the pybind front end, the other .cpp files and every .cu file."""
    front = csrc / f"{EXT_NAME}.cpp"
    return [front] + sorted(p for p in csrc.glob("*.cpp") if p != front) + sorted(csrc.glob("*.cu"))


def _nvcc_home(nvcc: str) -> Optional[Path]:
    """The toolkit behind an nvcc on PATH, following wrapper scripts and symlinks."""
    real = Path(nvcc).resolve()
    if (real.parent.parent / "include" / "cuda_runtime.h").is_file():
        return real.parent.parent
    # A wrapper script (e.g. /usr/local/bin/nvcc exec'ing the real one): ask nvcc.
    try:
        out = subprocess.run([nvcc, "--dryrun", "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"_HERE_=(\S+)", out.stdout + out.stderr)
    return Path(m.group(1)).resolve().parent if m else None


def find_cuda_home() -> Optional[Path]:
    """CUDA_HOME / CUDA_PATH, else the toolkit of the nvcc on PATH, else /usr/local/cuda.
    A set CUDA_HOME / CUDA_PATH without ``bin/nvcc`` is skipped here; :func:`build` refuses it."""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var) and (Path(os.environ[var]) / "bin" / "nvcc").exists():
            return Path(os.environ[var])
    nvcc = shutil.which("nvcc")
    if nvcc and (home := _nvcc_home(nvcc)) is not None:
        return home
    default = Path("/usr/local/cuda")
    return default if (default / "bin" / "nvcc").exists() else None


def check_cuda_home_env() -> None:
    """A CUDA_HOME / CUDA_PATH the user set must point at a toolkit (not silently some other nvcc)."""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        value = os.environ.get(var)
        if value and not (Path(value) / "bin" / "nvcc").exists():
            raise ExtensionBuildError(
                f"{var}={value} has no bin/nvcc" + ("" if Path(value).is_dir() else " (the directory does not exist)"),
                fix=f"point {var} at the CUDA toolkit (the directory holding bin/nvcc), or unset it to use the "
                    f"nvcc on PATH or /usr/local/cuda")


def ensure_writable_dir(path: Path) -> Path:
    """Create ``path`` (and parents) and check this process can write there, or say what to set."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write-probe-{os.getpid()}"
        probe.touch()
        probe.unlink()
    except OSError as e:
        raise ExtensionBuildError(
            f"cannot write the extension build directory {path}: {e.strerror or e}",
            fix="set MPTRAIN_BUILD_DIR (or --build-dir) to a directory this process can write, e.g. "
                "MPTRAIN_BUILD_DIR=/tmp/mptrain-build") from None
    return path


def _extra_include_dirs(cuda_home: Path) -> list[str]:
    """Library headers torch's CUDA headers include (cusparse.h, cublas_v2.h, ...) when the
    toolkit lacks them but the nvidia-* wheels torch depends on ship them."""
    wanted = ("cusparse.h", "cublas_v2.h", "cusolverDn.h", "cublasLt.h", "curand.h")
    missing = [h for h in wanted if not (cuda_home / "include" / h).is_file()]
    if not missing:
        return []
    sites = {Path(p) for p in sys.path if p.endswith("site-packages")}
    incs = (inc for site in sites for inc in sorted(site.glob("nvidia/*/include")))
    return list(dict.fromkeys(str(inc) for inc in incs if any((inc / h).is_file() for h in missing)))


def arch_list() -> list[str]:
    """Target archs like ["9.0"] or ["8.0", "9.0+PTX"]."""
    env = os.environ.get("TORCH_CUDA_ARCH_LIST", "").strip()
    if env:
        return [a for a in re.split(r"[;,\s]+", env) if a]
    if torch.cuda.is_available():
        caps = {torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())}
        return [f"{major}.{minor}" for major, minor in sorted(caps)]
    return ["9.0"]


def gencode_flags(archs: list[str]) -> list[str]:
    flags = []
    for a in archs:
        ptx = a.endswith("+PTX")
        a = a.removesuffix("+PTX")
        m = re.fullmatch(r"(?:sm_)?(\d+)\.?(\d)([af]?)", a)
        if not m:
            raise ExtensionBuildError(f"TORCH_CUDA_ARCH_LIST entry {a!r} is not an arch like 9.0 or 8.6+PTX",
                                      fix='set TORCH_CUDA_ARCH_LIST="9.0" (H100/H200)')
        num = f"{m.group(1)}{m.group(2)}{m.group(3)}"
        flags.append(f"-gencode=arch=compute_{num},code=sm_{num}")
        if ptx:
            flags.append(f"-gencode=arch=compute_{num},code=compute_{num}")
    return flags


def _all_flags(cuda_home: Optional[Path]) -> tuple[list[str], list[str]]:
    """(C++ flags, nvcc flags), both with the include dirs the toolkit lacks (see _extra_include_dirs)."""
    extra = [f"-I{d}" for d in _extra_include_dirs(cuda_home)] if cuda_home is not None else []
    cuda = ["-O3", "--expt-relaxed-constexpr"] + gencode_flags(arch_list())
    if os.environ.get("MPTRAIN_SMALL_KERNEL_ARGS") == "1":
        cuda.append("-DMPT_SMALL_KERNEL_ARGS")
    return ["-O3"] + extra, cuda + extra


def _loaded_cublas() -> Optional[Path]:
    """The libcublas.so.<major> this process has mapped (torch's CUDA library loads it), or None."""
    with contextlib.suppress(OSError), open("/proc/self/maps") as maps:
        for line in maps:
            path = Path(line.split(maxsplit=5)[-1].strip())
            if re.fullmatch(r"libcublas\.so\.\d+(\.\d+)*", path.name):
                return path
    return None


def cublas_ldflags(cuda_home: Optional[Path]) -> list[str]:
    """Link flags for cuBLAS (the LSTM GEMMs call it on torch's handle): the libcublas.so.<major> torch
    has loaded, by file name, so the loader reuses torch's copy (one cuBLAS, torch's handle valid for our
    calls); else the toolkit's libcublas.so; empty when neither exists (build() then stops with the fix)."""
    lib = _loaded_cublas()
    if lib is not None:
        return [f"-L{lib.parent}", f"-l:{lib.name}"]
    if cuda_home is not None:
        for sub in ("lib64", "lib", "targets/x86_64-linux/lib", "targets/sbsa-linux/lib"):
            if (cuda_home / sub / "libcublas.so").exists():
                return [f"-L{cuda_home / sub}", "-lcublas"]
    return []


def build_hash(csrc: Path, flags: list[str], cuda_home: Optional[Path]) -> str:
    h = hashlib.sha256()
    for f in sorted(p for p in csrc.iterdir() if p.suffix in _SOURCE_SUFFIXES):
        h.update(f.name.encode())
        h.update(f.read_bytes())
    for item in (torch.__version__, torch.version.cuda, sys.version, str(cuda_home), *flags):
        h.update(str(item).encode())
    return h.hexdigest()[:16]


@contextlib.contextmanager
def _torch_arch_list(archs: list[str]) -> Iterator[None]:
    """TORCH_CUDA_ARCH_LIST set to our archs while cpp_extension builds, when the user has not set it.
    cpp_extension adds its own -gencode flags from it: without it, torch picks the visible GPUs' archs,
    and torch 2.6 fails with an IndexError where there is no GPU (this machine's CI)."""
    if os.environ.get("TORCH_CUDA_ARCH_LIST", "").strip():
        yield
        return
    os.environ["TORCH_CUDA_ARCH_LIST"] = ";".join(archs)
    try:
        yield
    finally:
        os.environ.pop("TORCH_CUDA_ARCH_LIST", None)


@contextlib.contextmanager
def build_lock(build_dir: Path, timeout: Optional[float] = None) -> Iterator[None]:
    """Hold the build directory exclusively while building or loading. The kernel drops the flock when
    its holder dies, so a killed build never blocks the next process; holding it also proves that torch's
    ``lock`` file, if present, belongs to a dead build: it is removed (``cpp_extension.load`` would wait)."""
    import fcntl

    if timeout is None:
        timeout = float(os.environ.get("MPTRAIN_BUILD_LOCK_TIMEOUT", "1800"))
    build_dir.mkdir(parents=True, exist_ok=True)
    path = build_dir / _LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        t0, told = time.monotonic(), False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                holder = "?"
                with contextlib.suppress(OSError):
                    holder = path.read_text().strip() or "?"
                waited = time.monotonic() - t0
                if waited > timeout:
                    raise ExtensionBuildError(
                        f"timed out after {timeout:.0f} s waiting for another process (pid {holder}) "
                        f"building the extension in {build_dir}",
                        fix=f"wait for pid {holder} to finish, or stop it; "
                        "MPTRAIN_BUILD_LOCK_TIMEOUT sets the wait") from None
                if waited > 10 and not told:
                    print(f"mptrain: waiting for pid {holder} to finish building in {build_dir}", file=sys.stderr)
                    told = True
                time.sleep(0.2)
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        # Older torch (FileBaton) blocks while this file merely exists; a killed build
        # leaves it behind. Newer torch flocks it and leaves it in place after every
        # build. Either way nobody can be using it while we hold our lock.
        (build_dir / "lock").unlink(missing_ok=True)
        yield
    finally:
        os.close(fd)  # drops the flock


def build_dir_for(csrc: Path, root: Optional[Path] = None, cuda_home: Optional[Path] = None) -> Path:
    """Where build() compiles ``csrc``: ``<root>/ext-<hash of sources, flags, versions>``."""
    cflags, cuda_flags = _all_flags(cuda_home)
    flags = cflags + cuda_flags + cublas_ldflags(cuda_home)
    root = root or os.environ.get("MPTRAIN_BUILD_DIR") or Path.home() / ".cache" / "mptrain"
    return Path(root) / f"ext-{build_hash(csrc, flags, cuda_home)}"


def build(csrc: Optional[Path] = None, root: Optional[Path] = None, verbose: bool = False):
    """Compile (or reuse the cached build of) ``csrc`` and load it: (module, build_dir). Leaves
    :func:`get_extension`'s process-wide state alone (tests call it on temporary source trees)."""
    csrc = Path(csrc) if csrc is not None else csrc_dir()
    check_cuda_home_env()
    cuda_home = find_cuda_home()
    srcs = sources(csrc)
    has_cuda = any(s.suffix == ".cu" for s in srcs)
    if has_cuda and cuda_home is None:
        raise ExtensionBuildError(
            "nvcc not found: no CUDA_HOME/CUDA_PATH, no nvcc on PATH, no /usr/local/cuda",
            fix="install the CUDA toolkit and set CUDA_HOME to it (the directory holding bin/nvcc)")
    if importlib.util.find_spec("ninja") is None and shutil.which("ninja") is None:
        raise ExtensionBuildError("ninja is not installed", fix="pip install ninja")
    cflags, cuda_flags = _all_flags(cuda_home)
    ldflags = cublas_ldflags(cuda_home) if has_cuda else []
    if has_cuda and not ldflags:
        raise ExtensionBuildError(
            f"libcublas not found: torch has not loaded one and {cuda_home} has no lib64/libcublas.so",
            fix="install torch's CUDA wheels (nvidia-cublas) or a CUDA toolkit with cuBLAS, and set CUDA_HOME to it")
    if cuda_home is not None:
        # cpp_extension reads CUDA_HOME when it is imported (and trusts a stale one): set ours.
        os.environ["CUDA_HOME"] = str(cuda_home)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    os.environ.setdefault("MAX_JOBS", str(cpus))
    build_dir = ensure_writable_dir(build_dir_for(csrc, root, cuda_home))
    log = build_dir / "build.log"
    cached = _load_cached(build_dir)
    if cached is not None:
        return cached, str(build_dir)
    from torch.utils import cpp_extension

    if cuda_home is not None:
        cpp_extension.CUDA_HOME = str(cuda_home)
    with build_lock(build_dir), _torch_arch_list(arch_list()):
        try:
            module = cpp_extension.load(
                name=EXT_NAME, sources=[str(s) for s in srcs], extra_cflags=cflags, extra_cuda_cflags=cuda_flags,
                extra_ldflags=ldflags, extra_include_paths=[str(csrc)], build_directory=str(build_dir), verbose=verbose,
                with_cuda=has_cuda)
        except ImportError as e:
            raise _load_error(e, build_dir) from None
        except (RuntimeError, subprocess.SubprocessError, OSError) as e:
            log.write_text(str(e))
            raise _compile_error(str(e), srcs, log) from None
        log.write_text(f"built {[s.name for s in srcs]} into {build_dir}\n")
        _write_stamp(build_dir)
    return module, str(build_dir)


# Warm start: cpp_extension.load costs seconds even when nothing changed. The build directory's name pins the
# sources, flags and versions, so once a build there has loaded, the next process imports its .so
# directly. The stamp holds the .so's size and mtime: a .so rewritten since (a killed relink) takes
# the full path, which rebuilds what is missing.

_STAMP_NAME = "loaded.stamp"


def _so_signature(so: Path) -> str:
    st = so.stat()
    return f"{st.st_size} {st.st_mtime_ns}"


def _write_stamp(build_dir: Path) -> None:
    so = build_dir / f"{EXT_NAME}.so"
    if so.is_file():
        (build_dir / _STAMP_NAME).write_text(_so_signature(so) + "\n")


def _import_so(so: Path):
    spec = importlib.util.spec_from_file_location(EXT_NAME, so)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _load_cached(build_dir: Path):
    """The module from a build that already loaded once in ``build_dir``, or None (then build)."""
    so, stamp = build_dir / f"{EXT_NAME}.so", build_dir / _STAMP_NAME
    if not stamp.is_file():
        return None
    with build_lock(build_dir):  # a concurrent builder of the same hash finishes first
        try:
            if stamp.read_text().strip() != _so_signature(so):
                return None
        except OSError:  # no .so (or no stamp) any more
            return None
        try:
            return _import_so(so)
        except ImportError as e:
            raise _load_error(e, build_dir) from None


def _compile_error(output: str, srcs: list[Path], log: Path) -> ExtensionBuildError:
    failing = None
    m = re.search(r"FAILED: (\S+)", output)
    if m:
        obj = Path(m.group(1)).name
        stem = re.sub(r"(\.cuda)?\.o$", "", obj)
        failing = next((str(p) for p in srcs if p.stem == stem), None)
        if failing is None and obj.endswith(".so"):
            failing = f"{obj} (link step)"
    # The first "file(line): error" or "file:line:col: error" names a header when that is where it is.
    m = re.search(r"^(\S+?\.(?:cu|cuh|cpp|h))(?:\((\d+)\)|:(\d+):\d+): (?:fatal )?error", output, re.M)
    first_error = f"{m.group(1)}:{m.group(2) or m.group(3)}" if m else None
    if m and failing is None:
        failing = m.group(1)
    if "Ninja is required" in output:
        fix = "pip install ninja"
    elif re.search(r"nvcc.*(not found|No such file)", output):
        fix = "set CUDA_HOME to the CUDA toolkit (the directory holding bin/nvcc)"
    elif re.search(r"[Uu]nsupported gpu architecture|unsupported.*arch", output):
        fix = "set TORCH_CUDA_ARCH_LIST to an arch this nvcc supports, e.g. 9.0"
    elif "undefined reference" in output or "undefined symbol" in output:
        fix = ("a function declared in csrc/mptrain_ext.cpp has no definition in any .cu file: "
               "check that the declaration matches the definition")
    elif failing:
        fix = (f"fix the compile error at {first_error or failing} (see the log), or run with fused=False "
               "to use the PyTorch reference kernels")
    else:
        fix = "read the log; run `python -m mptrain.ops.build --verbose` to see every compiler command"
    summary = next((ln.strip() for ln in output.splitlines() if " error" in ln or "error:" in ln), "")
    return ExtensionBuildError(f"building the mptrain CUDA extension failed: {summary[:300]}",
                               failing_file=failing, log_path=str(log), fix=fix)


def _load_error(e: ImportError, build_dir: Path) -> ExtensionBuildError:
    msg = str(e)
    if "libcuda" in msg or "no CUDA-capable device" in msg or "driver" in msg.lower():
        fix = "this machine has no NVIDIA driver: the extension compiled but can only be loaded on a GPU machine"
    else:
        fix = f"the cached build does not match this torch: delete {build_dir} and rebuild"
    return ExtensionBuildError(f"the extension was built but could not be loaded: {msg}",
                               failing_file=str(build_dir / f"{EXT_NAME}.so"), log_path=str(build_dir / "build.log"),
                               fix=fix)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mptrain.ops.build",
                                     description="Build the mptrain CUDA extension.")
    parser.add_argument("--csrc", type=Path, help="csrc directory (default: $MPTRAIN_CSRC or the repository's)")
    parser.add_argument("--build-dir", type=Path, help="cache root (default: $MPTRAIN_BUILD_DIR or ~/.cache/mptrain)")
    parser.add_argument("--clean", action="store_true", help="delete this configuration's cached build first")
    parser.add_argument("--verbose", action="store_true", help="print every compiler command and its output")
    args = parser.parse_args(argv)
    csrc = args.csrc or csrc_dir()
    print(f"csrc: {csrc} ({len(sources(csrc))} translation units)")
    print(f"CUDA_HOME: {find_cuda_home()}  archs: {arch_list()}  MAX_JOBS: {os.environ.get('MAX_JOBS', 'auto')}")
    t0 = time.perf_counter()
    try:
        if args.clean:
            shutil.rmtree(build_dir_for(csrc, args.build_dir, find_cuda_home()), ignore_errors=True)
        module, build_dir = build(csrc, args.build_dir, verbose=args.verbose)
    except ExtensionBuildError as e:
        so = Path(e.failing_file or "")
        if so.suffix == ".so" and so.is_file():
            # GPU-less CI: everything compiled and linked; only loading needs a driver.
            print(f"compiled and linked in {time.perf_counter() - t0:.1f} s: {so}")
            print(f"not loadable on this machine: {e}")
            return 0
        print(f"build failed after {time.perf_counter() - t0:.1f} s\n  {e}", file=sys.stderr)
        return 1
    ops = sorted(n for n in dir(module) if not n.startswith("_"))
    print(f"built and loaded in {time.perf_counter() - t0:.1f} s: {build_dir}")
    print(f"{len(ops)} ops: {', '.join(ops)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
