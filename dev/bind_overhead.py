"""What a call from Python into a custom op costs, by binding (lab tool, not shipped; CPU is enough).

    python3 dev/bind_overhead.py

A trivial op with LayerNorm's schema (returns its input) called as ``torch.ops`` OpOverload,
through the OpOverload's C++ callable, and through a pybind11 function calling the typed
dispatcher handle; beside them torch's generated bindings (``torch.add``, ``x.view``).  The
session-8 question: is the host gap of ``ops.layer_norm`` to ``F.layer_norm`` at tiny shapes
(3-4 us on the H200) in our Python wrapper or in the op's binding?  Answer on the CPU box:
the wrapper costs ~0.5 us, the boxed OpOverload call ~2.5 us more than a generated binding,
and pybind11 is slower still (optional<Tensor> / IntArrayRef casters).
"""
import time

import torch
from torch.utils.cpp_extension import load_inline

CPP = r'''
#include <torch/extension.h>
#include <torch/library.h>
#include <ATen/core/dispatch/Dispatcher.h>
std::tuple<at::Tensor, at::Tensor> ln_cpu(const at::Tensor& x, at::IntArrayRef s, const std::optional<at::Tensor>& w,
                                          const std::optional<at::Tensor>& b, double eps, bool rms) {
  return {x, x};
}
TORCH_LIBRARY(mptrain_bind_probe, m) {
  m.def("ln(Tensor x, int[] s, Tensor? w, Tensor? b, float eps, bool rms) -> (Tensor, Tensor)");
}
TORCH_LIBRARY_IMPL(mptrain_bind_probe, CPU, m) { m.impl("ln", &ln_cpu); }
at::Tensor ln_typed(const at::Tensor& x, at::IntArrayRef s, const std::optional<at::Tensor>& w,
                    const std::optional<at::Tensor>& b, double eps, bool rms) {
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mptrain_bind_probe::ln", "")
      .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, at::IntArrayRef, const std::optional<at::Tensor>&,
                                                const std::optional<at::Tensor>&, double, bool)>();
  return std::get<0>(op.call(x, s, w, b, eps, rms));
}
'''


def per_call_us(f, n=100_000):
    for _ in range(2000):
        f()
    t0 = time.perf_counter()
    for _ in range(n):
        f()
    return (time.perf_counter() - t0) / n * 1e6


def main():
    ext = load_inline("mptrain_bind_probe", cpp_sources=[CPP], functions=["ln_typed"])
    op = torch.ops.mptrain_bind_probe.ln.default
    x, w, b = torch.randn(4, 256), torch.randn(256), torch.randn(256)
    rows = {"OpOverload": lambda: op(x, (256,), w, b, 1e-5, False),
            "OpOverload._op": lambda: op._op(x, (256,), w, b, 1e-5, False),
            "pybind11 typed handle": lambda: ext.ln_typed(x, (256,), w, b, 1e-5, False),
            "torch.add(x, x) (generated binding + kernel)": lambda: torch.add(x, x),
            "x.view(-1) (generated binding, no kernel)": lambda: x.view(-1)}
    for name, f in rows.items():
        print(f"{name:<48} {per_call_us(f):6.2f} us")


if __name__ == "__main__":
    main()
