// Lean Python entry points for the custom ops whose host time is compared with torch's
// own at tiny shapes (LayerNorm / RMSNorm, one per normalization layer per step; max
// pooling).
//
// Why: calling torch.ops.mptrain.layer_norm goes through the boxed path (the arguments
// parsed against the schema into IValues, the results boxed back), which costs ~4 us of
// host time more than torch's generated binding for the same work; a pybind11 function
// costs more still (its casters).  This is a METH_FASTCALL function, as torch's
// generated bindings are: tensors are read straight off the Python objects and the op is
// called through its typed dispatcher handle, so dispatch (autograd, the CUDA kernel,
// Python dispatch modes) is the op's as registered.
//
// Each takes only the plain case and answers NotImplemented for everything else, which the
// caller (mptrain/ops/layer_norm.py, pool.py) then sends through torch.ops as before: tensor
// subclasses and active torch-function modes (__torch_function__ must see the op), CUDA
// autocast (the caller upcasts), dtypes other than float32/float16/bfloat16, parameters
// that are neither in x's dtype nor float32, a normalized_shape that is not an int or a
// sequence of ints; for the pool, input that is not 4-d channels_last, windows of more than
// 127 elements, sizes that are not an int or two ints.
#include <ATen/ATen.h>
#include <ATen/PythonTorchFunctionTLS.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>

#include <c10/util/SmallVector.h>

#include <array>
#include <limits>
#include <optional>
#include <tuple>

#include "autograd_node.h"
#include "entry_points.h"

namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;
using LnFwd = std::tuple<Tensor, Tensor>(const Tensor&, at::IntArrayRef, const OptTensor&, const OptTensor&, double,
                                         bool);
using PoolFwd = std::tuple<Tensor, Tensor>(const Tensor&, at::IntArrayRef, at::IntArrayRef, at::IntArrayRef);

PyObject* not_implemented() { Py_RETURN_NOTIMPLEMENTED; }

bool kernel_dtype(at::ScalarType t) { return t == at::kFloat || t == at::kHalf || t == at::kBFloat16; }

// A tensor argument (or None) that is a plain Tensor or Parameter; false (a subclass, whose
// __torch_function__ must see the op, or not a tensor): take the torch.ops path.
bool plain(PyObject* o, OptTensor& out) {
  if (o == Py_None) return true;
  if (!THPVariable_CheckExact(o)) return false;
  out = THPVariable_Unpack(o);
  return true;
}

// normalized_shape: an int or a tuple / list (torch.Size included) of ints.
bool int_list(PyObject* o, c10::SmallVector<int64_t, 4>& out) {
  if (PyLong_CheckExact(o)) {
    out.push_back(PyLong_AsLongLong(o));
  } else if (PyTuple_Check(o) || PyList_Check(o)) {
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(o);
    PyObject** items = PySequence_Fast_ITEMS(o);
    for (Py_ssize_t i = 0; i < n; ++i) {
      if (!PyLong_CheckExact(items[i])) return false;
      out.push_back(PyLong_AsLongLong(items[i]));
    }
  } else {
    return false;
  }
  if (PyErr_Occurred()) {  // an int beyond int64: the torch.ops path reports it
    PyErr_Clear();
    return false;
  }
  return true;
}

// norm(x, normalized_shape, weight, bias, eps, rms) -> y, or NotImplemented.  eps None: torch's
// RMSNorm default for these dtypes (float32 machine epsilon).
PyObject* norm(PyObject* /*self*/, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (nargs != 6) {
    PyErr_SetString(PyExc_TypeError, "norm(x, normalized_shape, weight, bias, eps, rms) takes 6 arguments");
    return nullptr;
  }
  if (at::impl::torch_function_mode_enabled()) return not_implemented();  // the mode must see the op
  OptTensor x, w, b;
  if (!plain(args[0], x) || !x || !plain(args[2], w) || !plain(args[3], b)) return not_implemented();
  const at::ScalarType xt = x->scalar_type();
  if (!kernel_dtype(xt)) return not_implemented();
  const auto wt = w ? w->scalar_type() : xt, bt = b ? b->scalar_type() : wt;
  const auto params = w ? wt : bt;  // the parameters' common dtype
  if (wt != bt && w && b) return not_implemented();
  if (params != xt && params != at::kFloat) return not_implemented();
  if (x->is_cuda() && at::autocast::is_autocast_enabled(at::kCUDA)) return not_implemented();
  c10::SmallVector<int64_t, 4> shape;
  if (!int_list(args[1], shape)) return not_implemented();
  double eps;
  if (args[4] == Py_None) {
    eps = std::numeric_limits<float>::epsilon();
  } else if (PyFloat_CheckExact(args[4])) {
    eps = PyFloat_AS_DOUBLE(args[4]);
  } else {
    return not_implemented();
  }
  const int rms = PyObject_IsTrue(args[5]);
  if (rms < 0) return nullptr;
  static const auto op = mpt::op<LnFwd>("mptrain::layer_norm");
  Tensor y;
  {
    pybind11::gil_scoped_release no_gil;  // as torch's bindings do around dispatch
    y = std::get<0>(op.call(*x, shape, w, b, eps, rms != 0));
  }
  return THPVariable_Wrap(std::move(y));
  END_HANDLE_TH_ERRORS
}

// kernel_size / stride / padding as torch's _pair takes them here: an int, or a tuple / list of
// two ints.
bool int_pair(PyObject* o, std::array<int64_t, 2>& out) {
  c10::SmallVector<int64_t, 4> v;
  if (!int_list(o, v) || (v.size() != 1 && v.size() != 2) || (v.size() == 1 && !PyLong_CheckExact(o))) return false;
  out = {v[0], v.back()};
  return true;
}

// max_pool2d(x, kernel_size, stride, padding) -> y (torch.ops.mptrain.max_pool2d(...)[0]), or
// NotImplemented.  stride None: kernel_size.  The op checks the values (positive, padding).
PyObject* max_pool2d(PyObject* /*self*/, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (nargs != 4) {
    PyErr_SetString(PyExc_TypeError, "max_pool2d(x, kernel_size, stride, padding) takes 4 arguments");
    return nullptr;
  }
  if (at::impl::torch_function_mode_enabled()) return not_implemented();
  OptTensor x;
  if (!plain(args[0], x) || !x || x->dim() != 4 || !kernel_dtype(x->scalar_type()) ||
      !x->is_contiguous(at::MemoryFormat::ChannelsLast))
    return not_implemented();
  std::array<int64_t, 2> k{}, s{}, p{};
  if (!int_pair(args[1], k) || !int_pair(args[3], p)) return not_implemented();
  if (args[2] == Py_None) {
    s = k;
  } else if (!int_pair(args[2], s)) {
    return not_implemented();
  }
  if (k[0] < 1 || k[1] < 1 || k[0] * k[1] > 127) return not_implemented();  // the caller's fallback or error
  static const auto op = mpt::op<PoolFwd>("mptrain::max_pool2d");
  Tensor y;
  {
    pybind11::gil_scoped_release no_gil;
    y = std::get<0>(op.call(*x, k, s, p));
  }
  return THPVariable_Wrap(std::move(y));
  END_HANDLE_TH_ERRORS
}

PyMethodDef methods[] = {
    {"norm", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(norm)), METH_FASTCALL,
     "norm(x, normalized_shape, weight, bias, eps, rms) -> torch.ops.mptrain.layer_norm(...)[0], or NotImplemented "
     "where the call must go through torch.ops (tensor subclasses, torch-function modes, CUDA autocast, other "
     "dtypes or argument types)"},
    {"max_pool2d", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(max_pool2d)), METH_FASTCALL,
     "max_pool2d(x, kernel_size, stride, padding) -> torch.ops.mptrain.max_pool2d(...)[0], or NotImplemented "
     "where the call must go through torch.ops (tensor subclasses, torch-function modes, input that is not 4-d "
     "channels_last float32/float16/bfloat16, other argument types)"},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace

void register_fast_calls(PyObject* module) {
  if (PyModule_AddFunctions(module, methods) != 0) throw pybind11::error_already_set();
}
