// Where sequence n lives: batch row, first time index, length. Shared by CPU and CUDA code.
#pragma once
#include <cstdint>

#if defined(__CUDACC__)
#define FLA_HD __host__ __device__ __forceinline__
#else
#define FLA_HD inline
#endif

namespace fla {

struct SeqSpan {
  int64_t b, bos, len;
};

// Boundary n of cu_seqlens clamped into [0, T]. The ops check cu_seqlens wherever that needs no
// device synchronisation (always on the CPU); a GPU cu_seqlens passed unchecked may hold anything,
// and clamping here keeps every sequence inside the tensors: rows in [0, T], reversed bounds
// empty. (Workspace slots stay in range too: kernels/chunk.h chunk_slot.)
FLA_HD int64_t seq_boundary(const int64_t* cu_seqlens, int n, int64_t T) {
  const int64_t x = cu_seqlens[n];
  return x < 0 ? 0 : (x > T ? T : x);
}

FLA_HD SeqSpan seq_span(const int64_t* cu_seqlens, int n, int T) {
  if (cu_seqlens) {
    const int64_t bos = seq_boundary(cu_seqlens, n, T), eos = seq_boundary(cu_seqlens, n + 1, T);
    return {0, bos, eos > bos ? eos - bos : 0};
  }
  return {n, 0, T};
}

}  // namespace fla
