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

FLA_HD SeqSpan seq_span(const int64_t* cu_seqlens, int n, int T) {
  if (cu_seqlens) return {0, cu_seqlens[n], cu_seqlens[n + 1] - cu_seqlens[n]};
  return {n, 0, T};
}

}  // namespace fla
