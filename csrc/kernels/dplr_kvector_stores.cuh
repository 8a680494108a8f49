// The five K-vector gradients of a chunk's rows from shared memory to their outputs, shared by
// the two-pass grad kernel and the single-pass backward (DplrChunkPaths::grads_16byte).
#pragma once
#include <cstring>
#include <type_traits>

#include "dplr_chunk.h"
#include "elements.cuh"

namespace fla {

// Rows [0, nrow) of the chunk whose first row is sequence row t0 (b, bos: the sequence), head h:
// gradient g's row i, channel d at src[g][i * ld + d] (16-byte aligned rows), 4 channels a thread
// of kThreads. A quad's row, channels and (grads_share_offsets: the five outputs share strides,
// as the op allocates them) its element offset once for all five: per (gradient, quad) the index
// split, the pick of the source rows and the output's 64-bit offsets would cost ~40
// instructions, more than the stores themselves. One 16-byte shared read a gradient (two per
// 16-byte piece would be two-way bank conflicts). Not synchronised.
template <typename T, int kThreads>
__device__ inline void store_kvector_quads(const DplrChunkPass& p, int64_t b, int64_t bos, int64_t t0, int h, int K,
                                           int nrow, const float* const (&src)[kNumKGrads], int ld) {
  const int pk = K / 4;
  for (int e = threadIdx.x; e < nrow * pk; e += kThreads) {
    const int i = e / pk, ch = (e - i * pk) * 4;
    const int64_t t = bos + t0 + i, off = elements::voff(p.kgd[0], b, t, h, ch);
#pragma unroll
    for (int gi = 0; gi < kNumKGrads; ++gi) {
      const VecArg& o = p.kgd[gi];
      const float4 f = *reinterpret_cast<const float4*>(src[gi] + i * ld + ch);
      T* const dst = static_cast<T*>(const_cast<void*>(o.ptr)) +
                     (p.paths.grads_share_offsets ? off : elements::voff(o, b, t, h, ch));
      if constexpr (std::is_same<T, float>::value) {
        *reinterpret_cast<float4*>(dst) = f;
      } else {
        const T v[4] = {elements::from_f<T>(f.x), elements::from_f<T>(f.y), elements::from_f<T>(f.z),
                        elements::from_f<T>(f.w)};
        uint2 raw;
        memcpy(&raw, v, sizeof(raw));
        *reinterpret_cast<uint2*>(dst) = raw;
      }
    }
  }
}

}  // namespace fla
