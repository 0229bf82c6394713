// Skinny GEMM with a transposed weight (decode and small batches, M <= 64), f16/bf16,
// float32 accumulation on tensor cores (mma.sync m16n8k16), streaming the weight once:
//
//   out[b, m, n] = act(alpha * sum_k a[b, m, k] * W[(b,) n, k] + beta * out_prev + bias[n])
//   a: (batch, M, K) row-major; W: (N, K) or (batch, N, K) row-major (w_bstride = 0 for 2-D),
//   i.e. b = W^T given as stored by a Linear layer. K % 8 == 0, a and W 16-byte aligned
//   (host checks); any M <= 8 * SK_MF, any N.
//
// Computed as out^T = W a^T: the mma A operand is a 16-row tile of W (rows n), the B operand
// is a^T (8 rows m of a per n8 fragment). No shared memory in the main loop: lane (g, t)
// (g = lane / 4, t = lane % 4) loads 16 bytes = k [c + 8t, c + 8t + 8) of W rows g and g + 8
// and of a rows g (+ 8f) for each 32-wide k-chunk c, and feeds them straight into two
// k16 mma steps. The reduction over k is order-free, so the k order inside a chunk is
// permuted the same way in both operands: step s, fragment k-columns (2t, 2t + 1) hold
// k = c + 8t + 4s + {0, 1} and columns (2t + 8, 2t + 9) hold k = c + 8t + 4s + {2, 3}:
//   A regs {W[g][..4s], W[g+8][..4s], W[g][..4s+2], W[g+8][..4s+2]} = words (2s, 2s, 2s+1, 2s+1)
//   B regs {a[g][..4s], a[g][..4s+2]}                                 = words (2s, 2s+1)
//
// Block: KS warps (blockDim.x = 32 * KS) on one 16 * SK_TR row slab of W; warp w sums the
// k-chunks [w * kcw, (w + 1) * kcw) and SK_U chunks of loads are in flight per round. The
// KS partial tiles are reduced through shared memory (dynamic, KS * SK_TR * SK_MF * 512 B),
// then the block applies the epilogue. Grid: (ceil(N / (16 * SK_TR)), 1, batch).
#include "gemm_common.cuh"

#ifndef SK_MF
#define SK_MF 1  // n8 fragments over M: M <= 8 * SK_MF
#endif
#ifndef SK_TR
#define SK_TR 1  // 16-row W tiles per warp
#endif
#ifndef SK_U
#define SK_U 4  // k-chunks per load round
#endif
#define SK_SLOTS (SK_TR * SK_MF * 4)  // accumulator registers per lane

// 16-byte weight load: read once, keep it out of L1 (a's rows live there).
__device__ __forceinline__ uint4 ld_stream16(const u16* p, bool ok) {
  uint4 v = make_uint4(0u, 0u, 0u, 0u);
  if (ok)
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
  return v;
}
// 16-byte activation load (re-read by every block: cached).
__device__ __forceinline__ uint4 ld_cached16(const u16* p, bool ok) {
  uint4 v = make_uint4(0u, 0u, 0u, 0u);
  if (ok)
    asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
  return v;
}
__device__ __forceinline__ u32 word(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

extern "C" __global__ void __launch_bounds__(256)
    gemm_skinny(const u16* __restrict__ A,  // (batch, M, K)
                const u16* __restrict__ W,  // (N, K) or (batch, N, K)
                u16* __restrict__ out,      // (batch, M, N)
                const u16* __restrict__ bias, int M, int N, int K, long long w_bstride, int kcw, float alpha,
                float beta, int act, int has_bias, int has_beta) {
  extern __shared__ float red[];  // [KS][SK_SLOTS][32]
  pdl_wait();  // launched with programmatic dependent launch on sm_90: the inputs' producer
  pdl_launch_dependents();
  const int lane = threadIdx.x & 31, ks = threadIdx.x >> 5, nks = blockDim.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int bz = blockIdx.z;
  const int n0 = blockIdx.x * (16 * SK_TR);
  const u16* Ab = A + (size_t)bz * M * K;
  const u16* Wb = W + (size_t)bz * w_bstride;
  const int chunks = (K + 31) >> 5;
  const int c_begin = ks * kcw, c_end = min(chunks, c_begin + kcw);

  const u16* wrow[SK_TR][2];
  bool wok[SK_TR][2];
#pragma unroll
  for (int tr = 0; tr < SK_TR; ++tr)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = n0 + tr * 16 + h * 8 + g;
      wok[tr][h] = row < N;
      wrow[tr][h] = Wb + (size_t)(row < N ? row : 0) * K + 8 * t;
    }
  const u16* arow[SK_MF];
  bool aok[SK_MF];
#pragma unroll
  for (int f = 0; f < SK_MF; ++f) {
    const int r = 8 * f + g;
    aok[f] = r < M;
    arow[f] = Ab + (size_t)(r < M ? r : 0) * K + 8 * t;
  }

  float acc[SK_TR][SK_MF][4];
#pragma unroll
  for (int tr = 0; tr < SK_TR; ++tr)
#pragma unroll
    for (int f = 0; f < SK_MF; ++f)
#pragma unroll
      for (int q = 0; q < 4; ++q) acc[tr][f][q] = 0.f;

  for (int c0 = c_begin; c0 < c_end; c0 += SK_U) {
    uint4 wv[SK_U][SK_TR][2], av[SK_U][SK_MF];
#pragma unroll
    for (int u = 0; u < SK_U; ++u) {
      const int c = c0 + u;
      const bool kin = c < c_end && c * 32 + 8 * t < K;
      const size_t off = (size_t)c * 32;
#pragma unroll
      for (int tr = 0; tr < SK_TR; ++tr)
#pragma unroll
        for (int h = 0; h < 2; ++h) wv[u][tr][h] = ld_stream16(wrow[tr][h] + off, kin && wok[tr][h]);
#pragma unroll
      for (int f = 0; f < SK_MF; ++f) av[u][f] = ld_cached16(arow[f] + off, kin && aok[f]);
    }
#pragma unroll
    for (int u = 0; u < SK_U; ++u) {
      if (c0 + u >= c_end) break;  // warp-uniform
#pragma unroll
      for (int s = 0; s < 2; ++s)
#pragma unroll
        for (int tr = 0; tr < SK_TR; ++tr)
#pragma unroll
          for (int f = 0; f < SK_MF; ++f)
            mma16816(acc[tr][f], word(wv[u][tr][0], 2 * s), word(wv[u][tr][1], 2 * s), word(wv[u][tr][0], 2 * s + 1),
                     word(wv[u][tr][1], 2 * s + 1), word(av[u][f], 2 * s), word(av[u][f], 2 * s + 1));
    }
  }

  // ---- reduce the KS warps' partial tiles through shared memory ----
  float* mine = red + (size_t)ks * (SK_SLOTS * 32);
#pragma unroll
  for (int tr = 0; tr < SK_TR; ++tr)
#pragma unroll
    for (int f = 0; f < SK_MF; ++f)
#pragma unroll
      for (int q = 0; q < 4; ++q) mine[((tr * SK_MF + f) * 4 + q) * 32 + lane] = acc[tr][f][q];
  __syncthreads();
  const Epi e{alpha, beta, act, has_bias, has_beta};
  // accumulator (tr, f, q) of lane (gg, tt): c0/c1 at W row gg, c2/c3 at W row gg + 8;
  // columns 2tt + (q & 1) of fragment f, i.e. out row m = 8f + 2tt + (q & 1).
  for (int i = threadIdx.x; i < SK_SLOTS * 32; i += blockDim.x) {
    float v = 0.f;
    for (int w = 0; w < nks; ++w) v += red[w * (SK_SLOTS * 32) + i];
    const int ln = i & 31, slot = i >> 5;
    const int q = slot & 3, f = (slot >> 2) % SK_MF, tr = slot / (4 * SK_MF);
    const int m = 8 * f + 2 * (ln & 3) + (q & 1);
    const int n = n0 + tr * 16 + (ln >> 2) + 8 * (q >> 1);
    if (m < M && n < N) {
      u16* p = out + ((size_t)bz * M + m) * N + n;
      const float prev = has_beta ? h2f(*p) : 0.f;
      const float bv = has_bias ? h2f(bias[n]) : 0.f;
      *p = f2h(epi_apply(e, v, prev, bv));
    }
  }
}
