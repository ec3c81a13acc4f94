"""mptrain.ops.build on the CPU: error messages of a failed build, stale locks, flags."""
import os
import shutil
import subprocess
import sys
import textwrap
import time
import warnings

import pytest

from mptrain.ops import build


def _broken_csrc(tmp_path, cu: bool):
    csrc = tmp_path / "csrc"
    csrc.mkdir()
    if cu:
        (csrc / "mptrain_ext.cpp").write_text("int mptrain_ext_placeholder = 0;\n")
        (csrc / "broken_kernel.cu").write_text("__global__ void k() { this is not cuda; }\n")
    else:
        (csrc / "mptrain_ext.cpp").write_text("this is not C++;\n")
    return csrc


def test_failed_build_names_the_file_the_log_and_the_fix(tmp_path):
    csrc = _broken_csrc(tmp_path, cu=False)
    with pytest.raises(build.ExtensionBuildError) as info:
        build.build(csrc, tmp_path / "cache")
    e = info.value
    assert e.failing_file.endswith("mptrain_ext.cpp")
    assert os.path.isfile(e.log_path) and "this is not C++" in open(e.log_path).read()
    assert "mptrain_ext.cpp" in str(e) and e.log_path in str(e) and "fused=False" in e.fix


@pytest.mark.skipif(build.find_cuda_home() is None, reason="needs nvcc")
def test_failed_cuda_build_names_the_cu_file(tmp_path):
    csrc = _broken_csrc(tmp_path, cu=True)
    with pytest.raises(build.ExtensionBuildError) as info:
        build.build(csrc, tmp_path / "cache")
    assert info.value.failing_file.endswith("broken_kernel.cu"), str(info.value)


def test_get_extension_falls_back_with_one_warning_and_reports_why(tmp_path, monkeypatch):
    csrc = _broken_csrc(tmp_path, cu=False)
    monkeypatch.setenv("MPTRAIN_CSRC", str(csrc))
    monkeypatch.setenv("MPTRAIN_BUILD_DIR", str(tmp_path / "cache"))
    for name, value in (("_module", None), ("_error", None), ("_status", build.ExtensionStatus("not attempted")),
                        ("_warned", False)):
        monkeypatch.setattr(build, name, value)
    assert build.extension_status() == "not attempted"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert build.get_extension() is None
        assert build.get_extension() is None
    assert len([w for w in caught if "reference" in str(w.message)]) == 1
    status = build.extension_status()
    assert status == "failed" and "mptrain_ext.cpp" in status.reason and status.log_path
    with pytest.raises(build.ExtensionBuildError, match="mptrain_ext.cpp"):
        build.get_extension(required=True)


def test_get_extension_builds_once_and_returns_the_module(monkeypatch):
    module, calls = object(), []
    monkeypatch.setattr(build, "build", lambda: calls.append(1) or (module, "/cache/ext-x"))
    for name, value in (("_module", None), ("_error", None), ("_status", build.ExtensionStatus("not attempted"))):
        monkeypatch.setattr(build, name, value)
    assert build.get_extension() is module and build.get_extension(required=True) is module
    assert calls == [1] and build.extension_status() == "built"
    assert "/cache/ext-x" in build.extension_status().describe()


def test_stale_torch_lock_is_removed(tmp_path):
    d = tmp_path / "ext"
    d.mkdir()
    (d / "lock").write_text("")  # what a build killed inside cpp_extension.load leaves behind
    with build.build_lock(d, timeout=5):
        assert not (d / "lock").exists()


def _holder(d, seconds):
    code = textwrap.dedent(f"""
        import pathlib, sys, time
        from mptrain.ops import build
        d = pathlib.Path({str(d)!r})
        with build.build_lock(d, timeout=5):
            (d / "lock").write_text("")        # torch's baton, as during a build
            print("held", flush=True)
            time.sleep({seconds})
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_lock_of_a_killed_build_does_not_hang_the_next(tmp_path):
    d = tmp_path / "ext"
    proc = _holder(d, 60)
    proc.kill()
    proc.wait()
    t0 = time.monotonic()
    with build.build_lock(d, timeout=10):
        assert not (d / "lock").exists()
    assert time.monotonic() - t0 < 5


def test_live_lock_holder_times_out_with_its_pid(tmp_path):
    d = tmp_path / "ext"
    proc = _holder(d, 30)
    try:
        with pytest.raises(build.ExtensionBuildError, match=f"pid {proc.pid}"):
            with build.build_lock(d, timeout=0.5):
                pass
    finally:
        proc.kill()
        proc.wait()


def test_gencode_flags_and_arch_list(monkeypatch):
    assert build.gencode_flags(["9.0"]) == ["-gencode=arch=compute_90,code=sm_90"]
    assert build.gencode_flags(["8.6+PTX"]) == ["-gencode=arch=compute_86,code=sm_86",
                                                 "-gencode=arch=compute_86,code=compute_86"]
    assert build.gencode_flags(["9.0a"]) == ["-gencode=arch=compute_90a,code=sm_90a"]
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0;9.0")
    assert build.arch_list() == ["8.0", "9.0"]
    with pytest.raises(build.ExtensionBuildError, match="TORCH_CUDA_ARCH_LIST"):
        build.gencode_flags(["hopper"])


def test_cuda_home_found_through_an_nvcc_wrapper(tmp_path, monkeypatch):
    real = tmp_path / "cuda-x"
    (real / "bin").mkdir(parents=True)
    wrapper = tmp_path / "bin" / "nvcc"
    wrapper.parent.mkdir()
    wrapper.write_text(f"#!/bin/sh\necho '#$ _HERE_={real}/bin'\n")
    wrapper.chmod(0o755)
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setenv("PATH", f"{wrapper.parent}:{os.environ['PATH']}")
    assert build.find_cuda_home() == real


def test_headers_the_toolkit_lacks_come_from_the_nvidia_wheels(tmp_path, monkeypatch):
    site = tmp_path / "site-packages"
    for pkg, header in (("cublas", "cublas_v2.h"), ("cusparse", "cusparse.h"), ("nccl", "nccl.h")):
        (site / "nvidia" / pkg / "include").mkdir(parents=True)
        (site / "nvidia" / pkg / "include" / header).write_text("")
    monkeypatch.setattr(sys, "path", [str(site), str(site)])
    toolkit = tmp_path / "cuda"
    (toolkit / "include").mkdir(parents=True)
    want = [str(site / "nvidia" / pkg / "include") for pkg in ("cublas", "cusparse")]
    assert build._extra_include_dirs(toolkit) == want
    for header in ("cusparse.h", "cublas_v2.h", "cusolverDn.h", "cublasLt.h", "curand.h"):
        (toolkit / "include" / header).write_text("")
    assert build._extra_include_dirs(toolkit) == []


def test_build_dir_hash_follows_the_sources(tmp_path):
    csrc = _broken_csrc(tmp_path, cu=False)
    h1 = build.build_hash(csrc, ["-O3"], None)
    (csrc / "type_shim.h").write_text("// changed\n")
    assert build.build_hash(csrc, ["-O3"], None) != h1
    assert build.build_hash(csrc, ["-O2"], None) != build.build_hash(csrc, ["-O3"], None)


def test_missing_csrc_says_how_to_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("MPTRAIN_CSRC", str(tmp_path))
    with pytest.raises(build.ExtensionBuildError, match="MPTRAIN_CSRC"):
        build.csrc_dir()


def _cached_build_dir(tmp_path, csrc):
    """The build directory build() picks for csrc under tmp_path/cache, holding a fake .so."""
    d = build.build_dir_for(csrc, tmp_path / "cache", build.find_cuda_home())
    d.mkdir(parents=True)
    (d / f"{build.EXT_NAME}.so").write_bytes(b"\x7fELF not really")
    return d


def test_warm_start_imports_the_stamped_so_without_cpp_extension(tmp_path, monkeypatch):
    csrc = _broken_csrc(tmp_path, cu=False)  # .cpp only: no nvcc needed to pick the directory
    d = _cached_build_dir(tmp_path, csrc)
    build._write_stamp(d)
    sentinel = object()
    monkeypatch.setattr(build, "_import_so", lambda so: sentinel)
    from torch.utils import cpp_extension

    def no_load(**kw):
        raise AssertionError("cpp_extension.load must not run for a stamped build")

    monkeypatch.setattr(cpp_extension, "load", no_load)
    assert build.build(csrc, tmp_path / "cache") == (sentinel, str(d))


def test_warm_start_ignores_a_changed_so_and_reports_load_errors(tmp_path, monkeypatch):
    csrc = _broken_csrc(tmp_path, cu=False)
    d = _cached_build_dir(tmp_path, csrc)
    build._write_stamp(d)
    so = d / f"{build.EXT_NAME}.so"
    so.write_bytes(b"\x7fELF rewritten by a relink that was killed")  # size differs from the stamp
    calls = []
    from torch.utils import cpp_extension

    def fake_load(**kw):
        calls.append(kw["build_directory"])
        return "rebuilt"

    monkeypatch.setattr(cpp_extension, "load", fake_load)
    assert build.build(csrc, tmp_path / "cache") == ("rebuilt", str(d))
    assert calls == [str(d)]
    # The full path re-stamps the .so it loaded; an import failure then names the file and the fix.
    assert (d / build._STAMP_NAME).read_text().strip() == build._so_signature(so)

    def broken_import(so):
        raise ImportError("libcuda.so.1: cannot open shared object file")

    monkeypatch.setattr(build, "_import_so", broken_import)
    with pytest.raises(build.ExtensionBuildError, match="libcuda") as info:
        build.build(csrc, tmp_path / "cache")
    assert info.value.failing_file.endswith(".so") and "driver" in info.value.fix


def _fresh_extension_state(monkeypatch):
    for name, value in (("_module", None), ("_error", None), ("_status", build.ExtensionStatus("not attempted")),
                        ("_warned", False)):
        monkeypatch.setattr(build, name, value)


@pytest.mark.parametrize("case", ["unwritable build dir", "CUDA_HOME pointing at nothing"])
def test_bad_build_environment_is_one_clear_message_and_the_references_keep_working(case, tmp_path, monkeypatch):
    """Neither case may end in a raw traceback or be ignored without a word."""
    if case == "unwritable build dir":
        blocker = tmp_path / "a-file"
        blocker.write_text("not a directory")
        monkeypatch.setenv("MPTRAIN_BUILD_DIR", str(blocker / "cache"))  # works for root too: a file is in the way
        want = "cannot write the extension build directory.*MPTRAIN_BUILD_DIR"
    else:
        monkeypatch.setenv("CUDA_HOME", str(tmp_path / "no-toolkit-here"))
        want = r"CUDA_HOME=.*no-toolkit-here has no bin/nvcc.*point CUDA_HOME at the CUDA toolkit"
    r = subprocess.run([sys.executable, "-m", "mptrain.ops.build"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert __import__("re").search(want, r.stderr.replace("\n", " ")), r.stderr
    _fresh_extension_state(monkeypatch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert build.get_extension() is None
    assert any("reference" in str(w.message) for w in caught)
    import torch

    from mptrain import ops

    x = torch.randn(4, 8)
    torch.testing.assert_close(ops.layer_norm(x, (8,)), torch.nn.functional.layer_norm(x, (8,)))
