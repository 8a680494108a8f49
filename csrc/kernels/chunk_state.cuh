// The state passes of the chunk engine (kernels/chunk.cuh) as one sequential kernel per
// (sequence, head, V tile, group of NK K tiles), forward or (BWD, below) backward. Forward: S
// (fp32) stays in registers across the chunks, S_{c+1} = diag(γ_c) S_c + K̂_cᵀ V_c with the
// products as the tile products elsewhere (TF32 for bf16/fp16 inputs, exact SIMT FMA for fp32). Each chunk-start state goes to hst when it is
// wanted (a backward reads it), the final one to the slot after the last chunk and to hT.
//
// With OUT the group covers all of K and the kernel also forms o_c = ρ (Q̂_c S_c + A_c V_c), A
// from amat (chunk_intra_kernel): the state never leaves the chip between the two. This replaces
// a parallel ΔS kernel, a serial elementwise scan and an out kernel that reread S (three fp32
// state round trips per chunk). Decay exponents are added, never subtracted, as in
// chunk.cuh: γ, K̂'s suffix factors and Q̂'s reader factors all come from chunk_decays.
#pragma once
#include "async_copy.cuh"
#include "chunk.cuh"

namespace fla {
namespace chunk_detail {

// A fragment into rows [0, R) x columns [0, Cn) of a row-major fp32 matrix m with row stride ld.
// Elements (i, i + 1), i even, are adjacent columns of one row in both Frag layouts: one 8-byte
// store where ld (and so every pair's offset) is even.
template <class F>
__device__ __forceinline__ void store_frag_mat(const F& f, float* m, int64_t ld, int R, int Cn) {
#pragma unroll
  for (int i = 0; i < 16; i += 2) {
    const int r = F::row(i), c = F::col(i);
    if (r >= R) continue;
    float* e = m + r * ld + c;
    if (ld % 2 == 0 && c + 1 < Cn) {
      *reinterpret_cast<float2*>(e) = make_float2(f.v[i], f.v[i + 1]);
    } else {
      if (c < Cn) e[0] = f.v[i];
      if (c + 1 < Cn) e[1] = f.v[i + 1];
    }
  }
}

// zeta partials of slot `slot` (workspace [slots, H, ceil(V / 32), K]): for each state row k,
// γ_k Σ S ⊙ D over each 32-column group. A thread's elements share one column group (Frag), and
// the lanes that share its rows and group are the low F::kGroupLanes lane bits.
template <class F>
__device__ __forceinline__ void zeta_partials(const F& D, const F& S, const float* gamma,
                                              const ChunkPass& p, int64_t slot, int h, int k0, int v0) {
  static_assert(kStateCols == 32, "a zeta partial is one Frag column group");
  float z[F::kRowsPer] = {};
#pragma unroll
  for (int i = 0; i < 16; ++i) z[F::row_slot(i)] += S.v[i] * D.v[i];
  const int grp = (v0 + F::col(0)) / kStateCols, nts = (p.V + kStateCols - 1) / kStateCols;
  float* const zs = static_cast<float*>(p.zeta) + ((slot * p.H + h) * nts + grp) * p.K + k0;
#pragma unroll
  for (int r = 0; r < F::kRowsPer; ++r) {
    float x = z[r];
#pragma unroll
    for (int off = 1; off < F::kGroupLanes; off <<= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
    const int row = F::slot_row(r);
    if (threadIdx.x % F::kGroupLanes == 0 && grp < nts && k0 + row < p.K) zs[row] = gamma[row] * x;
  }
}

// A fragment's elements of state rows [0, R) x columns [0, Cn) from a row-major fp32 matrix m
// (row stride ld), zero elsewhere: the loads of store_frag_mat. L2: through L2 only (__ldcg), for
// a matrix another CTA stored during this kernel (its lines are not in this SM's L1).
template <class F, bool L2 = false>
__device__ __forceinline__ void load_frag_mat(F& f, const float* m, int64_t ld, int R, int Cn) {
  auto load = [](const auto* a) {
#ifdef __CUDA_ARCH__
    if constexpr (L2) return __ldcg(a);
#endif
    return *a;
  };
#pragma unroll
  for (int i = 0; i < 16; i += 2) {
    const int r = F::row(i), c = F::col(i);
    const float* e = m + r * ld + c;
    if (r < R && ld % 2 == 0 && c + 1 < Cn) {
      const float2 x = load(reinterpret_cast<const float2*>(e));
      f.v[i] = x.x, f.v[i + 1] = x.y;
    } else {
      f.v[i] = r < R && c < Cn ? load(e) : 0.f;
      f.v[i + 1] = r < R && c + 1 < Cn ? load(e + 1) : 0.f;
    }
  }
}

// Windows of the chunk index (WIN; ChunkPass::window_chunks; BWD in the walk's order). The walk
// of a (sequence, head, V tile, K group) is cut into windows of window_chunks chunks, a CTA each,
// the window the slowest grid index, so that a window's predecessor was dispatched before it (as
// single-pass scans rely on). A CTA walks its window twice: first from a zero state (window 0:
// the initial state) for its local end state, which needs nothing from the predecessor; then it
// waits for the predecessor's flag, forms the true state at its end, Γ ⊙ S_in + S_local (Γ the
// window's decay, a product of the chunks' γ: the decay is diagonal, so the step is elementwise),
// stores it in window_states as the next window's start and raises its own flag; then it walks
// the window again from S_in, as the plain kernel does. The chain between windows is one flag and
// one elementwise step, not a walk.
__device__ __forceinline__ void window_fence() {
#ifdef __CUDA_ARCH__
  __threadfence();
#endif
}
__device__ __forceinline__ void raise_flag(int* flag) {
#ifdef __CUDA_ARCH__
  atomicExch(flag, 1);
#else
  *flag = 1;
#endif
}
__device__ __forceinline__ void wait_flag(int* flag) {
#ifdef __CUDA_ARCH__
  while (atomicAdd(flag, 0) == 0) __nanosleep(64);
  __threadfence();
#else
  (void)flag;  // the emulator runs CTAs in order: the predecessor has finished
#endif
}

// Grid (N, H, ntv x K groups [x windows]), z = [window x groups +] group * ntv + V tile. One CTA
// walks its sequence's chunks (its window's, WIN) in order (reverse order for BWD); the loads of
// the next K tile (or chunk) are issued right after the current one is stored to shared memory.
// At K <= 64 with o there is one CTA per (sequence, head) and V tile: built for one an SM (no
// register cap) and for two (CTAS = 2: 128 registers, a little spill), which launch_state runs
// where those CTAs are more than one wave at one an SM.
//
// BWD runs the backward state pass of the same algebra, D = dS+ from dht backwards:
// dHst[c] = D, the zeta partials γ_c ⊙ rowsum(S_c ⊙ D) per 32 columns (S_c from hst), then
// D = diag(γ_c) D + ρ Q̂_cᵀ dO_c, and dh0 = D at the end. It replaced a parallel ΔD kernel and a
// serial elementwise scan (two fp32 state round trips per chunk).
// The windowed walks are many CTAs by design: two an SM.
template <bool OUT, int NK, bool WIN>
constexpr int kStateCtas = OUT && NK == 1 && !WIN ? 1 : 2;
template <typename T, Reader RD, bool OUT, int NK, bool BWD = false, bool WIN = false,
          int CTAS = kStateCtas<OUT, NK, WIN>>
__global__ void __launch_bounds__(NTH, CTAS) chunk_state_kernel(ChunkPass p, int ntv, bool vec) {
  static_assert(!(BWD && OUT) && (NK == 1 || OUT), "o is a forward output; NK > 1 only for it");
  static_assert(CTAS == kStateCtas<OUT, NK, WIN> || (OUT && NK == 1 && !WIN), "CTAS: the walk with o at K <= 64");
  extern __shared__ float4 smem4[];
  // B operands and the transposed A operand at stride LDB, A operands [row][k] at LD (tile_mma.cuh).
  TileB* X = reinterpret_cast<TileB*>(smem4);  // v (BWD: dO)
  TileB* Y = X + C;                            // k, then K̂ = k ⊙ exp2(Qex) after[m] (BWD: q, ρQ̂)
  TileB* LS = Y + C;                           // λ, then (OUT) the chunk-start state tile
  Tile* Q = reinterpret_cast<Tile*>(LS + C);   // (OUT) q, then Q̂ = q ⊙ exp2(reader) before[m]
  Tile* AM = Q + C;                            // (OUT) A
  Decays& d = *reinterpret_cast<Decays*>(OUT ? AM + C : Q);
  float* const gamw = reinterpret_cast<float*>(&d + 1);  // (WIN) [NK][DT] the window's decay

  const int n = blockIdx.x, h = blockIdx.y;
  const int groups = ntv * ((p.K + NK * DT - 1) / (NK * DT));  // CTAs per (sequence, head, window)
  const int zz = WIN ? int(blockIdx.z) % groups : int(blockIdx.z), w = WIN ? int(blockIdx.z) / groups : 0;
  const int kt0 = zz / ntv * NK, v0 = zz % ntv * DT;
  const int m = threadIdx.x / DT, ch = threadIdx.x % DT;
  // Every mma operand is stored as TF32 values (v and A are already: widened inputs, intra).
  constexpr bool TC = kTC<T>;
  const SeqSpan s = seq_span(p.cu_seqlens, n, p.T);
  const int64_t nch = num_chunks(s.len), slot0 = chunk_slot(p.cu_seqlens, n, p.T, 0);
  // The chunks this CTA walks: all, or (WIN) its window's.
  const int64_t i_begin = WIN ? int64_t(w) * p.window_chunks : 0;
  const int64_t i_end = WIN ? (i_begin + p.window_chunks < nch ? i_begin + p.window_chunks : nch) : nch;
  if (WIN && w > 0 && i_begin >= nch) return;  // (window 0 writes an empty sequence's final state)
  const int64_t KV = int64_t(p.K) * p.V;
  float* const hst = static_cast<float*>(p.hst);
  float* const out_states = BWD ? static_cast<float*>(p.dhst) : hst;
  // This CTA's corner of slot `slot`'s state matrix, K tile kt.
  auto corner = [&](float* base, int64_t slot, int kt) {
    return base + (slot * p.H + h) * KV + int64_t(kt0 + kt) * DT * p.V + v0;
  };
  const int vleft = p.V - v0;
  auto kleft = [&](int kt) { return p.K - (kt0 + kt) * DT; };
  const MatArg& init = BWD ? p.dht : p.h0;
  const MatArg& fin = BWD ? p.dh0 : p.hT;

  // K tile kt of the initial state (BWD: dht), zero when off.
  auto initial = [&](int kt) {
    Acc<T> a;
    if (init.on())
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        const int r = Acc<T>::row(i), c = Acc<T>::col(i);
        if (r < kleft(kt) && c < vleft) a.v[i] = *mptr(init, n, h, (kt0 + kt) * DT + r, v0 + c);
      }
    return a;
  };
  Acc<T> S[NK];  // BWD: D
#pragma unroll
  for (int kt = 0; kt < NK; ++kt) S[kt] = initial(kt);

  using Pc = RowPieces<T>;
  Pc fq, fk, fg, fv;
  const PieceSrc<T> sq(p.q, s, h, kt0 * DT, p.K), sk(BWD ? p.q : p.k, s, h, kt0 * DT, p.K);
  const PieceSrc<T> sg(p.g, s, h, kt0 * DT, p.K), sv(BWD ? p.dout : p.v, s, h, v0, p.V);
  const PieceSrc<T> so(p.o, s, h, v0, p.V);
  auto chunk_rows = [&](int64_t c) { return int(s.len - c * C < C ? s.len - c * C : C); };
  auto chunk_of = [&](int64_t i) { return BWD ? nch - 1 - i : i; };  // the i-th chunk walked
  Acc<T> Sn;  // BWD: the next chunk's S (zeta), loaded with its pieces
  auto fetch = [&](int64_t i, int kt, bool full = true) {  // full off: the windows' first walk
    if (i >= i_end) return;
    const int64_t c = chunk_of(i);
    const int L = chunk_rows(c);
    auto one = [&](Pc& f, const PieceSrc<T>& a, int dk) {
      f.fetch(a.p + c * C * a.st + dk * a.sd, a.st, a.sd, L, a.cols - dk, vec);
    };
    if (OUT && full) one(fq, sq, kt * DT);
    one(fk, sk, kt * DT), one(fg, sg, kt * DT);
    if (kt == 0) one(fv, sv, 0);
    if (BWD && full) load_frag_mat(Sn, corner(hst, slot0 + c, 0), p.V, kleft(0), vleft);
  };
  const float* const amat = static_cast<const float*>(p.amat);
  auto pairs_of = [&](int64_t c) { return amat + ((slot0 + c) * p.H + h) * int64_t(C) * C; };
  const float rho = float(p.scale);
  if constexpr (WIN) {
    // First walk: the window from a zero state (window 0: from the initial state, or dht, already
    // in S), state products alone, and Γ. Window w's start state (forward: its first chunk's
    // state; BWD: dS+ of its last chunk in time, the walk's first) is handed to it in
    // window_states' slot w x N + n; the walks store their states where they store them unwindowed.
    float* const handed = p.window_states;
    const int64_t slot_in = int64_t(w) * p.N + n, slot_out = slot_in + p.N;
    auto flag = [&](int win) {
      return p.window_flags + int64_t(win) * p.N * p.H * groups + (int64_t(n) * p.H + h) * groups + zz;
    };
    if (w > 0)
#pragma unroll
      for (int kt = 0; kt < NK; ++kt) S[kt] = Acc<T>();
    for (int e = threadIdx.x; e < NK * DT; e += NTH) gamw[e] = 1.f;
    fetch(i_begin, 0, false);
    for (int64_t i = i_begin; i < i_end; ++i) {
#pragma unroll
      for (int kt = 0; kt < NK; ++kt) {
        __syncthreads();
        fk.store(Y, 1.f), fg.store(LS, kLog2e);
        if (kt == 0) fv.store(X, 1.f);
        if (kt + 1 < NK) fetch(i, kt + 1, false);
        else fetch(i + 1, 0, false);
        __syncthreads();
        chunk_decays(d, LS);
        if (BWD) scale_reader<RD, TC>(Y, LS, m, ch, rho * d.before[m][ch]);
        else scale_key<false, TC>(Y, LS, m, ch, d.after[m][ch]);
        if (threadIdx.x < DT) gamw[kt * DT + threadIdx.x] *= d.gamma[threadIdx.x];
        __syncthreads();
#pragma unroll
        for (int e = 0; e < 16; ++e) S[kt].v[e] *= d.gamma[Acc<T>::row(e)];
        S[kt].template mma<true, Tri::Full, true>(Y, X, C);
      }
    }
    // The state at the window's end, Γ ⊙ S_in + S_local, into hst (dhst) as the next window's start.
    if (w > 0 && threadIdx.x == 0) wait_flag(flag(w - 1));
    __syncthreads();
#pragma unroll
    for (int kt = 0; kt < NK; ++kt) {
      if (w > 0) {
        Acc<T> sin;
        load_frag_mat<Acc<T>, true>(sin, corner(handed, slot_in, kt), p.V, kleft(kt), vleft);
#pragma unroll
        for (int e = 0; e < 16; ++e) S[kt].v[e] += gamw[kt * DT + Acc<T>::row(e)] * sin.v[e];
      }
      if (i_end < nch) store_frag_mat(S[kt], corner(handed, slot_out, kt), p.V, kleft(kt), vleft);
    }
    if (i_end < nch) {
      window_fence();
      __syncthreads();
      if (threadIdx.x == 0) raise_flag(flag(w));
    }
    // Second walk from the true start state: the initial state, or what the predecessor stored.
#pragma unroll
    for (int kt = 0; kt < NK; ++kt) {
      if (w > 0) {
        load_frag_mat<Acc<T>, true>(S[kt], corner(handed, slot_in, kt), p.V, kleft(kt), vleft);
      } else {
        S[kt] = initial(kt);
      }
    }
    __syncthreads();  // the first walk's tiles are consumed
  }
  fetch(i_begin, 0);
  if (OUT && i_end > i_begin) copy_pairs(AM, pairs_of(chunk_of(i_begin)));

  for (int64_t i = i_begin; i < i_end; ++i) {
    const int64_t c = chunk_of(i);
    Acc<T> o, Sc;
#pragma unroll
    for (int kt = 0; kt < NK; ++kt) {
      __syncthreads();  // the previous K tile's (or chunk's) tiles are consumed
      if (OUT) fq.store(Q, 1.f);
      fk.store(Y, 1.f), fg.store(LS, kLog2e);
      if (kt == 0) fv.store(X, 1.f);
      if (BWD) Sc = Sn;
      if (kt + 1 < NK) fetch(i, kt + 1);
      else fetch(i + 1, 0);
      __syncthreads();
      chunk_decays(d, LS);
      if (OUT) scale_reader<RD, TC>(Q, LS, m, ch, d.before[m][ch]);
      if (BWD) scale_reader<RD, TC>(Y, LS, m, ch, rho * d.before[m][ch]);
      else scale_key<false, TC>(Y, LS, m, ch, d.after[m][ch]);
      if (out_states) store_frag_mat(S[kt], corner(out_states, slot0 + c, kt), p.V, kleft(kt), vleft);
      if (BWD) zeta_partials(S[kt], Sc, d.gamma, p, slot0 + c, h, kt0 * DT, v0);
      __syncthreads();
      if (OUT) {  // o += Q̂ S_c, S_c staged over λ (dead now)
        stage<Acc<T>, TC>(S[kt], LS, 1.f);
        __syncthreads();
        o.template mma<false, Tri::Full, true>(Q, LS, DT);
      }
#pragma unroll
      for (int e = 0; e < 16; ++e) S[kt].v[e] *= d.gamma[Acc<T>::row(e)];
      S[kt].template mma<true, Tri::Full, true>(Y, X, C);
    }
    if (OUT) {
      copy_wait<0>();
      __syncthreads();
      o.template mma<false, Tri::KUpToRow, true>(AM, X, C);  // A is lower triangular
      stage(o, LS, 1.f);                                // LS is free since the sync
      __syncthreads();
      if (i + 1 < i_end) copy_pairs(AM, pairs_of(c + 1));
      if (p.o_acc) {  // fp32 o (ChunkPass::o_acc) in its own pieces, addressed per chunk
        const PieceSrc<float> sf(p.o, s, h, v0, p.V);
        RowPieces<float>::put(LS, sf.p + c * C * sf.st, sf.st, sf.sd, chunk_rows(c), sf.cols, vec, rho);
      } else {
        Pc::put(LS, so.p + c * C * so.st, so.st, so.sd, chunk_rows(c), so.cols, vec, rho);
      }
    }
  }

  if (WIN && i_end < nch) return;  // the final state is the last window's
#pragma unroll
  for (int kt = 0; kt < NK; ++kt) {
    if (!BWD && hst) store_frag_mat(S[kt], corner(hst, slot0 + nch, kt), p.V, kleft(kt), vleft);
    if (fin.on())
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        const int r = Acc<T>::row(i), c = Acc<T>::col(i);
        if (r < kleft(kt) && c < vleft) *mptr(fin, n, h, (kt0 + kt) * DT + r, v0 + c) = S[kt].v[i];
      }
    if (!BWD && hst && p.cu_seqlens) {  // hst may be kept as an op output: its gap slots read 0
      const int64_t next = n + 1 < p.N ? chunk_slot(p.cu_seqlens, n + 1, p.T, 0)
                                       : chunk_slots(p.N, p.T, true);
      const Acc<T> zero;
      for (int64_t c = nch + 1; slot0 + c < next; ++c)
        store_frag_mat(zero, corner(hst, slot0 + c, kt), p.V, kleft(kt), vleft);
    }
  }
}

// The `vec` argument of chunk_state_kernel: every activation it reads or writes is whole pieces.
template <typename T>
inline bool state_vec(const ChunkPass& p, bool out, bool bwd) {
  constexpr int P = RowPieces<T>::P;
  if (bwd) return rows_in_pieces(p.q, p.K, P) && rows_in_pieces(p.g, p.K, P) && rows_in_pieces(p.dout, p.V, P);
  const bool kv = rows_in_pieces(p.k, p.K, P) && rows_in_pieces(p.g, p.K, P) && rows_in_pieces(p.v, p.V, P);
  return kv && (!out || (rows_in_pieces(p.q, p.K, P) && rows_in_pieces(p.o, p.V, P)));
}

// Whether a state pass walks in windows of the chunk index (ChunkPass::window_chunks).
inline bool state_windows(const ChunkPass& p) {
  return p.window_chunks > 0 && p.window_flags && p.window_states && p.T > 0;
}

constexpr size_t state_smem(bool out, int nk = 1, bool win = false) {
  return sizeof(float) * C * (3 * tile::LDB + (out ? 2 * LD : 0)) + sizeof(Decays) +
         (win ? sizeof(float) * nk * DT : 0);
}

}  // namespace chunk_detail
}  // namespace fla
