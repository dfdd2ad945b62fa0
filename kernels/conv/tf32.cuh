#pragma once

// TF32 rounding shared by the conv kernels: the MMAs truncate a float32
// operand's low 13 mantissa bits, so inputs are rounded first.

#include <cstdint>

namespace torchfuse::kernels {

// v rounded to TF32, to nearest with ties away from zero (cvt.rna).
__device__ __forceinline__ float roundTf32(float v) {
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(v));
  return __uint_as_float(r);
}

}  // namespace torchfuse::kernels
