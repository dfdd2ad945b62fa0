#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

namespace torchfuse::ops {

// Checks shared by the ops.  Each message starts with the op's name, names the
// argument and gives what was expected and what was received.

void checkDefined(const char* op, const char* name, const at::Tensor& t);
void checkDim(const char* op, const char* name, const at::Tensor& t, int64_t dim);
void checkSameDevice(
    const char* op,
    const char* name,
    const at::Tensor& t,
    const at::Tensor& ref);
void checkSameDtype(
    const char* op,
    const char* name,
    const at::Tensor& t,
    const at::Tensor& ref);
void checkFloating(const char* op, const char* name, const at::Tensor& t);
// `other` must broadcast with the shape of the fused op's main result.
void checkBroadcastable(
    const char* op,
    const at::Tensor& other,
    at::IntArrayRef result_sizes);

// True when some tensor has symbolic sizes (fake tensors under dynamic-shape
// tracing): Meta kernels then skip the size checks, which need concrete sizes.
bool anySymbolic(std::initializer_list<at::Tensor> tensors);

// True for an undefined tensor or a dense, strided, non-quantized,
// non-nested one on a device with torchfuse kernels (CPU, CUDA, Meta): the
// tensors the ops' own kernels take.  Others (sparse, quantized, MKL-DNN,
// other backends) make an op run its reference, the original ATen chain.
bool isPlainDenseTensor(const at::Tensor& t);

} // namespace torchfuse::ops
