// Shared helpers for every .cu file: dtype dispatch over the three storage types
// we support (fp32/fp16/bf16), input checks with useful messages, launch checks.
// Kept free of <torch/extension.h> so each .cu pulls in only ATen's light headers.
#pragma once
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "check.h"

// at::Half / at::BFloat16 are layout-compatible with __half / __nv_bfloat16 and
// convert to float on the device, which is all the kernels need (math is fp32).
#define MPT_DISPATCH_FLOAT_HALF_BF16(TYPE, NAME, SCALAR_T, ...)                   \
  switch (TYPE) {                                                                \
    case at::ScalarType::Float: {                                                \
      using SCALAR_T = float;                                                    \
      __VA_ARGS__;                                                               \
      break;                                                                     \
    }                                                                            \
    case at::ScalarType::Half: {                                                 \
      using SCALAR_T = at::Half;                                                 \
      __VA_ARGS__;                                                               \
      break;                                                                     \
    }                                                                            \
    case at::ScalarType::BFloat16: {                                             \
      using SCALAR_T = at::BFloat16;                                             \
      __VA_ARGS__;                                                               \
      break;                                                                     \
    }                                                                            \
    default:                                                                     \
      MPT_CHECK(false, NAME, ": unsupported dtype ", TYPE,                       \
                " (expected float32, float16 or bfloat16)");                     \
  }

#define MPT_CHECK_CUDA(x, NAME) \
  MPT_CHECK((x).is_cuda(), NAME, ": tensor '" #x "' must be a CUDA tensor, got ", (x).device())
#define MPT_CHECK_CONTIGUOUS(x, NAME) \
  MPT_CHECK((x).is_contiguous(), NAME, ": tensor '" #x "' must be contiguous")

// Every launch is followed by this: a bad launch configuration surfaces at the
// call site with the op's name instead of at some later unrelated sync.
#define MPT_CHECK_LAUNCH(NAME) C10_CUDA_KERNEL_LAUNCH_CHECK()
