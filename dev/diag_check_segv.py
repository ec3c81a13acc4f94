"""Diagnostic (not a test): on the GPU machine a TORCH_CHECK raised from our extension
segfaulted when its message streams a number.  Builds one tiny extension with the
same check in a .cpp (g++) and a .cu (nvcc) and raises each in a subprocess."""
import subprocess
import sys
import tempfile

CPP = r"""
#include <torch/extension.h>
void raise_cpp(int64_t n) { TORCH_CHECK(n < 0, "cpp: n=", n, " device ", torch::Device(torch::kCUDA, 0)); }
void raise_cpp_literal(int64_t n) { TORCH_CHECK(n < 0, "cpp literal only"); }
void raise_cu(int64_t n);
void raise_cu_literal(int64_t n);
void raise_cu_tostring(int64_t n);
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("raise_cpp", &raise_cpp); m.def("raise_cpp_literal", &raise_cpp_literal);
  m.def("raise_cu", &raise_cu); m.def("raise_cu_literal", &raise_cu_literal);
  m.def("raise_cu_tostring", &raise_cu_tostring);
}
"""
CU = r"""
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <string>
void raise_cu(int64_t n) { TORCH_CHECK(n < 0, "cu: n=", n); }
void raise_cu_literal(int64_t n) { TORCH_CHECK(n < 0, "cu: literal only"); }
void raise_cu_tostring(int64_t n) { TORCH_CHECK(n < 0, "cu: n=", std::to_string(n)); }
"""

if len(sys.argv) > 1:  # child: build (cached) and raise one
    from torch.utils.cpp_extension import load_inline
    m = load_inline("mpt_check_diag", CPP, CU, build_directory=sys.argv[2],
                    extra_cuda_cflags=["-O3", "--expt-relaxed-constexpr", "-gencode=arch=compute_90a,code=sm_90a"])
    try:
        getattr(m, sys.argv[1])(5)
        print("no error")
    except RuntimeError as e:
        print("raised:", str(e).splitlines()[0])
    sys.exit(0)

d = tempfile.mkdtemp()
subprocess.run([sys.executable, __file__, "raise_cpp_literal", d], capture_output=True)  # build once
for name in ("raise_cpp_literal", "raise_cpp", "raise_cu_literal", "raise_cu", "raise_cu_tostring"):
    r = subprocess.run([sys.executable, __file__, name, d], capture_output=True, text=True)
    print(f"{name}: rc {r.returncode}: {(r.stdout.strip() or r.stderr.strip()[-300:])}", flush=True)
