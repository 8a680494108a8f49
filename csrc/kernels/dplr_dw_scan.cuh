// dw's reverse scan over a chunk's rows (docs/algorithms.md §6.4), shared by the two-pass grad
// kernel (dplr_chunk_grad.cuh) and the single-pass backward (dplr_chunk_fused_backward_grads.cuh):
// per row t, latest first, acc += x_t; acc = 0 where exp(w_t) == 0 (z_t); dw_t = acc; acc += y_t,
// acc entering the chunk's last row being zeta. Both split a channel's rows into groups over
// several threads: each group's map of the sum entering it (dw_group_map), zeta carried through
// the later groups' maps (dw_through; the callers exchange the maps, grad by shuffles, the single
// pass through shared memory), then the group's rows (dw_group_scan).
#pragma once

namespace fla {

// A group's rows, in row order: the sum leaving it is (sum entering) + c where no row resets it
// (keep), else c.
template <int n>
__device__ __forceinline__ void dw_group_map(const float (&x)[n], const float (&y)[n], const bool (&z)[n], float& c,
                                             bool& keep) {
  c = 0.f, keep = true;
#pragma unroll
  for (int r = n - 1; r >= 0; --r) c = z[r] ? y[r] : c + x[r] + y[r], keep = keep && !z[r];
}

// acc through a later group's map.
__device__ __forceinline__ float dw_through(float acc, float c, bool keep) { return keep ? acc + c : c; }

// The group's dw from acc, the sum entering it.
template <int n>
__device__ __forceinline__ void dw_group_scan(float acc, const float (&x)[n], const float (&y)[n], const bool (&z)[n],
                                              float (&dw)[n]) {
#pragma unroll
  for (int r = n - 1; r >= 0; --r) {
    acc += x[r];
    if (z[r]) acc = 0.f;
    dw[r] = acc;
    acc += y[r];
  }
}

}  // namespace fla
