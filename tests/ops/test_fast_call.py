"""The extension's lean entry points (csrc/fast_call.cpp: norm, max_pool2d) on CPU tensors: same results
and gradients as ``torch.ops.mptrain.layer_norm`` / ``max_pool2d``, NotImplemented for what they leave to
torch.ops, errors raised as Python exceptions.

Needs a build of csrc/ already in the cache (CI compiles one before the tests; this never builds).
It runs in a subprocess: loading the extension registers the CUDA kernels for the whole process,
which the other CPU tests must not see.  The subprocess also finds the cached build, as a fresh
process like ``python -m mptrain.ops.build`` does (the build directory's name depends on the
libraries a process has loaded).
"""
import subprocess
import sys
import textwrap

import pytest


SCRIPT = textwrap.dedent("""
    import sys
    import torch
    from mptrain.ops import build
    from mptrain.ops.library import OPS

    ext = build._load_cached(build.build_dir_for(build.csrc_dir(), cuda_home=build.find_cuda_home()))
    if ext is None:
        print("no-cached-build")
        sys.exit(0)
    norm, ln = ext.norm, OPS["layer_norm"]
    torch.manual_seed(0)

    def leaves(dtype, wdtype):
        x = torch.randn(6, 32, dtype=dtype, requires_grad=True)
        w = torch.randn(32, dtype=wdtype, requires_grad=True)
        b = torch.randn(32, dtype=wdtype, requires_grad=True)
        return x, w, b

    # same values and gradients as the torch.ops call (the op's CPU kernel and Python autograd)
    for dtype, wdtype in ((torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                          (torch.bfloat16, torch.float32)):
        for rms in (False, True):
            x, w, b = leaves(dtype, wdtype)
            bias = None if rms else b
            shape = (32,) if dtype == torch.float32 else torch.Size([32])
            y = norm(x, shape, w, bias, 1e-5, rms)
            y2 = ln(x, (32,), w, bias, 1e-5, rms)[0]
            assert y.dtype == dtype and torch.equal(y, y2), (dtype, wdtype, rms)
            dy = torch.randn_like(y)
            inputs = (x, w) if rms else (x, w, b)
            g = torch.autograd.grad(y, inputs, dy)
            g2 = torch.autograd.grad(y2, inputs, dy)
            assert all(torch.equal(a, c) for a, c in zip(g, g2)), (dtype, wdtype, rms)
    x, w, b = leaves(torch.float32, torch.float32)
    assert torch.equal(norm(x, 32, w, b, 1e-5, False), ln(x, (32,), w, b, 1e-5, False)[0])  # an int shape
    eps = torch.finfo(torch.float32).eps
    assert torch.equal(norm(x, [32], w, None, None, True), ln(x, (32,), w, None, eps, True)[0])  # RMS default eps

    # left to torch.ops
    class Sub(torch.Tensor):
        pass

    class Mode(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with torch.no_grad():
        cases = {
            "subclass input": (x.as_subclass(Sub), (32,), w, b, 1e-5, False),
            "subclass weight": (x, (32,), w.as_subclass(Sub), b, 1e-5, False),
            "int64 input": (torch.ones(2, 32, dtype=torch.int64), (32,), None, None, 1e-5, False),
            "fp16 params under bf16 input": (x.bfloat16(), (32,), w.half(), b.half(), 1e-5, False),
            "weight and bias dtypes differ": (x, (32,), w, b.double(), 1e-5, False),
            "shape of floats": (x, (32.0,), w, b, 1e-5, False),
            "shape as a string": (x, "32", w, b, 1e-5, False),
            "int eps": (x, (32,), w, b, 0, False),
            "x not a tensor": ([1.0], (32,), w, b, 1e-5, False),
        }
        for name, args in cases.items():
            assert norm(*args) is NotImplemented, name
        with Mode():
            assert norm(x, (32,), w, b, 1e-5, False) is NotImplemented, "torch-function mode"

    # errors come back as Python exceptions, not crashes
    for args, exc in (((x, (16,), w, b, 1e-5, False), ValueError), ((x, (32,)), TypeError)):
        try:
            norm(*args)
        except exc:
            pass
        else:
            sys.exit(f"no {exc.__name__} for {args[1:]}")

    # max pooling: the op's values and gradients for channels_last input
    pool, mp = ext.max_pool2d, OPS["max_pool2d"]
    for dtype in (torch.float32, torch.bfloat16):
        xp = torch.randn(2, 8, 9, 9, dtype=dtype).contiguous(memory_format=torch.channels_last).requires_grad_()
        for args, full in (((3, 2, 1), ([3, 3], [2, 2], [1, 1])), (((3, 2), [2, 1], (1, 0)), ([3, 2], [2, 1], [1, 0])),
                           ((2, None, 0), ([2, 2], [2, 2], [0, 0]))):
            y, y2 = pool(xp, *args), mp(xp, *full)[0]
            assert y.dtype == dtype and torch.equal(y, y2), (dtype, args)
            dy = torch.randn_like(y)
            assert torch.equal(torch.autograd.grad(y, xp, dy)[0], torch.autograd.grad(y2, xp, dy)[0]), (dtype, args)
    xp = xp.detach().float()
    with torch.no_grad():
        declined = {
            "subclass input": (xp.as_subclass(Sub), 3, 2, 1),
            "int64 input": (torch.ones(2, 8, 9, 9, dtype=torch.int64).contiguous(memory_format=torch.channels_last),
                            3, 2, 1),
            "not channels_last": (xp.contiguous(), 3, 2, 1),
            "3-d input": (xp[0], 3, 2, 1),
            "a one-element tuple": (xp, (3,), 2, 1),
            "a float size": (xp, 3.0, 2, 1),
            "three sizes": (xp, (3, 3, 3), 2, 1),
            "an empty stride": (xp, 3, [], 1),
            "a window over 127 elements": (xp, 12, 1, 0),
            "a zero window": (xp, 0, 1, 0),
            "x not a tensor": ([1.0], 3, 2, 1),
        }
        for name, args in declined.items():
            assert pool(*args) is NotImplemented, name
        with Mode():
            assert pool(xp, 3, 2, 1) is NotImplemented, "torch-function mode"
    for args, exc in (((xp, 3, 2, 2), ValueError), ((xp, 3, 2), TypeError)):  # padding over half the window
        try:
            pool(*args)
        except exc:
            pass
        else:
            sys.exit(f"no {exc.__name__} for max_pool2d{args[1:]}")
    print("fast-call-ok")
""")


def test_fast_entry_points_match_the_ops_and_decline_what_they_do_not_take():
    r = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    if r.returncode == 0 and "no-cached-build" in r.stdout:
        pytest.skip("no cached build of csrc/ (python -m mptrain.ops.build)")
    assert r.returncode == 0 and "fast-call-ok" in r.stdout, r.stdout + r.stderr
