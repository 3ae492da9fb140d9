// What deepinfer's CPU kernels (int_matmul.cpp, latent_attention.cpp: one library, built by
// runtime/int_matmul.py) share: tensors read through torch's stable C ABI, new ones made through
// it, a C shim's error handling, and bfloat16 bits.
#pragma once

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/util/Exception.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <vector>

namespace deepinfer {

// A tensor the caller holds (a stable::Tensor's handle, or one of AOTInductor's generated code),
// read through the stable C ABI without taking a reference of its own.
struct View {
  AtenTensorHandle handle;

  int64_t dim() const {
    int64_t d;
    STD_TORCH_CHECK(aoti_torch_get_dim(handle, &d) == AOTI_TORCH_SUCCESS, "aoti_torch_get_dim");
    return d;
  }
  int64_t size(int64_t d) const {  // (d < 0 counts from the end)
    int64_t n;
    STD_TORCH_CHECK(aoti_torch_get_size(handle, d < 0 ? d + dim() : d, &n) == AOTI_TORCH_SUCCESS, "aoti_torch_get_size");
    return n;
  }
  int64_t stride(int64_t d) const {
    int64_t* strides;
    STD_TORCH_CHECK(aoti_torch_get_strides(handle, &strides) == AOTI_TORCH_SUCCESS, "aoti_torch_get_strides");
    return strides[d < 0 ? d + dim() : d];
  }
  int64_t numel() const {
    int64_t n;
    STD_TORCH_CHECK(aoti_torch_get_numel(handle, &n) == AOTI_TORCH_SUCCESS, "aoti_torch_get_numel");
    return n;
  }
  bool of(int32_t dtype) const {  // of this dtype (aoti_torch_dtype_*())
    int32_t own;
    STD_TORCH_CHECK(aoti_torch_get_dtype(handle, &own) == AOTI_TORCH_SUCCESS, "aoti_torch_get_dtype");
    return own == dtype;
  }
  bool is(int32_t dtype) const {  // of this dtype and contiguous
    bool contiguous;
    STD_TORCH_CHECK(aoti_torch_is_contiguous(handle, &contiguous) == AOTI_TORCH_SUCCESS, "aoti_torch_is_contiguous");
    return of(dtype) && contiguous;
  }
  void* data() const {  // (at the view's first element)
    void* p;
    STD_TORCH_CHECK(aoti_torch_get_data_ptr(handle, &p) == AOTI_TORCH_SUCCESS, "aoti_torch_get_data_ptr");
    return p;
  }
};

// A new uninitialized contiguous CPU tensor: a handle the caller owns.
inline AtenTensorHandle empty(const std::vector<int64_t>& shape, int32_t dtype) {
  std::vector<int64_t> strides(shape.size(), 1);
  for (int64_t d = int64_t(shape.size()) - 2; d >= 0; --d) strides[d] = strides[d + 1] * shape[d + 1];
  AtenTensorHandle out;
  STD_TORCH_CHECK(aoti_torch_empty_strided(int64_t(shape.size()), shape.data(), strides.data(), dtype, aoti_torch_device_type_cpu(), 0,
                                           &out) == AOTI_TORCH_SUCCESS, "aoti_torch_empty_strided");
  return out;
}

// A C shim's body: its error said on stderr (the generated code that called it only learns that it
// failed), as torch's own shims do.
template <class Body>
AOTITorchError shim(const char* op, Body body) {
  try {
    body();
    return AOTI_TORCH_SUCCESS;
  } catch (const std::exception& error) {
    std::fprintf(stderr, "deepinfer::%s: %s\n", op, error.what());
    return AOTI_TORCH_FAILURE;
  }
}

inline float bits_to_float(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
inline float bf16_to_float(uint16_t bits) { return bits_to_float(uint32_t(bits) << 16); }
inline uint16_t float_to_bf16(float f) {  // (round to nearest even; weights and activations are finite)
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  return uint16_t((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

}  // namespace deepinfer
