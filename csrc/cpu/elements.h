// Element access shared by the CPU backends: VecArg/MatArg addressing, the parameter vectors
// given in their own dtype (u), and the storage-type dispatch. bf16/f16 convert through float.
#pragma once
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>

#include "../kernels/tensor_args.h"

namespace fla::cpu {

// Kernel views carry const pointers for inputs; outputs use the same view type, so the
// constness is dropped here and nowhere else.
template <typename T>
inline T* elem(const VecArg& v, int64_t b, int64_t t, int h, int d) {
  return const_cast<T*>(static_cast<const T*>(v.ptr)) + b * v.sb + t * v.st + h * v.sh + d * v.sd;
}

template <typename T>
inline T* elem(const MatArg& m, int n, int h, int r, int c) {
  return static_cast<T*>(m.ptr) + n * m.sn + h * m.sh + r * m.sr + c * m.sc;
}

// An output element in the storage type T, or in the acc type A where `acc` (an o / dq written
// from the accumulators: ChunkPass::o_acc / dq_acc, RecurrentPass::out_acc).
template <typename T, typename A>
inline void put(const VecArg& v, bool acc, int64_t b, int64_t t, int h, int d, A x) {
  if (acc) *elem<A>(v, b, t, h, d) = x;
  else *elem<T>(v, b, t, h, d) = static_cast<T>(x);
}

template <typename A, typename T>
inline A load(const VecArg& v, int64_t b, int64_t t, int h, int d) {
  return static_cast<A>(*elem<T>(v, b, t, h, d));
}

// Element i of a contiguous parameter (u: [H, D]) stored as `dt`: kernels read it as given
// rather than paying a conversion per call.
template <typename A>
inline A load_param(DType dt, const void* u, int64_t i) {
  switch (dt) {
    case DType::f32: return A(static_cast<const float*>(u)[i]);
    case DType::f64: return A(static_cast<const double*>(u)[i]);
    case DType::bf16: return A(float(static_cast<const c10::BFloat16*>(u)[i]));
    case DType::f16: return A(float(static_cast<const c10::Half*>(u)[i]));
  }
  return A(0);
}

// Calls f(T{}, Acc{}) with the element type T of `dt` and its acc type Acc (the type of
// states and workspaces: float, double for f64 inputs).
template <typename F>
inline void dispatch_dtype(DType dt, F&& f) {
  switch (dt) {
    case DType::f32: return f(float{}, float{});
    case DType::f64: return f(double{}, double{});
    case DType::bf16: return f(c10::BFloat16{}, float{});
    case DType::f16: return f(c10::Half{}, float{});
  }
}

}  // namespace fla::cpu
