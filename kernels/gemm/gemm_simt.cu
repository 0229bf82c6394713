// float32 SGEMM on CUDA cores (any sm): register tiling, double-buffered shared memory.
//
//   out[b, m, n] = act(alpha * sum_k a[b, m, k] * B[k, n] + beta * out_prev + bias[n])
//   a: (batch, M, K) row-major; B: (K, N) or (batch, K, N) row-major (b_bstride = 0 for 2-D),
//   or with GEMM_TRANS_B (N, K) / (batch, N, K).
//
// Block tile 128 x 128 x 8, 256 threads as 16 x 16; thread (ty, tx) owns the 8 x 8
// outputs rows {4ty + i, 64 + 4ty + i}, cols {4tx + j, 64 + 4tx + j} (i, j < 4), so
// its shared-memory fragment reads are float4 and bank-conflict free.
// As[2][8][128 + 4] holds the A tile transposed (k-major), Bs[2][8][128] the B tile.
// The next k-tile is loaded to registers while the current one is multiplied.
// vec = 1: rows 16-byte aligned (K % 4 == 0, N % 4 == 0, aligned pointers) -> float4
// global loads; otherwise guarded scalar loads. Split-K as in gemm_sm80.cu.
// GEMM_TRANS_B = 1: B given as (N, K) / (batch, N, K): loaded like A (4 consecutive k of
// one n per thread) and stored transposed into Bs (k-major), so the inner loop is the same.
#include "gemm_common.cuh"

#ifndef GEMM_TRANS_B
#define GEMM_TRANS_B 0
#endif

#define SBM 128
#define SBN 128
#define SBK 8
#define APADR (SBM + 4)

extern "C" __global__ void __launch_bounds__(256, 2)
    gemm_simt(const float* __restrict__ A, const float* __restrict__ B, float* __restrict__ out,
              const float* __restrict__ bias, float* __restrict__ ws, int M, int N, int K, int batch,
              long long b_bstride, int splits, int kps, int vec, float alpha, float beta, int act,
              int has_bias, int has_beta) {
  __shared__ __align__(16) float As[2][SBK][APADR];
#if GEMM_TRANS_B
  __shared__ __align__(16) float Bs[2][SBK][APADR];
#else
  __shared__ __align__(16) float Bs[2][SBK][SBN];
#endif
  const int tid = threadIdx.x;
  const int tx = tid & 15, ty = tid >> 4;
  const int tn = blockIdx.x, tm = blockIdx.y;
  const int bz = blockIdx.z / splits, sp = blockIdx.z % splits;
  const int kt_total = (K + SBK - 1) / SBK;
  const int kb = sp * kps, ke = min(kt_total, kb + kps);
  const float* Ab = A + (size_t)bz * M * K;
  const float* Bb = B + (size_t)bz * b_bstride;
  const int m0 = tm * SBM, n0 = tn * SBN;
  // loader coordinates: A row ar, k offset ak (4 consecutive k); B row bk, col bn (4 consecutive n)
  const int ar = tid >> 1, ak = (tid & 1) * 4;
#if !GEMM_TRANS_B
  const int bk = tid >> 5, bn = (tid & 31) * 4;
#endif

  float ra[4], rb[4];
  auto gload = [&](int kt) {
    const int k0 = kt * SBK;
    const int gr = m0 + ar, gk = k0 + ak;
    if (vec) {
      float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
      if (gr < M && gk < K) v = *reinterpret_cast<const float4*>(Ab + (size_t)gr * K + gk);
      ra[0] = v.x; ra[1] = v.y; ra[2] = v.z; ra[3] = v.w;
    } else {
#pragma unroll
      for (int i = 0; i < 4; ++i) ra[i] = (gr < M && gk + i < K) ? Ab[(size_t)gr * K + gk + i] : 0.f;
    }
#if GEMM_TRANS_B
    const int gn = n0 + ar, gkb = k0 + ak;  // thread loads B[gn][gkb .. gkb + 3]
    if (vec) {
      float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
      if (gn < N && gkb < K) v = *reinterpret_cast<const float4*>(Bb + (size_t)gn * K + gkb);
      rb[0] = v.x; rb[1] = v.y; rb[2] = v.z; rb[3] = v.w;
    } else {
#pragma unroll
      for (int i = 0; i < 4; ++i) rb[i] = (gn < N && gkb + i < K) ? Bb[(size_t)gn * K + gkb + i] : 0.f;
    }
#else
    const int gkb = k0 + bk, gn = n0 + bn;
    if (vec) {
      float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
      if (gkb < K && gn < N) v = *reinterpret_cast<const float4*>(Bb + (size_t)gkb * N + gn);
      rb[0] = v.x; rb[1] = v.y; rb[2] = v.z; rb[3] = v.w;
    } else {
#pragma unroll
      for (int i = 0; i < 4; ++i) rb[i] = (gkb < K && gn + i < N) ? Bb[(size_t)gkb * N + gn + i] : 0.f;
    }
#endif
  };
  auto sstore = [&](int buf) {
#pragma unroll
    for (int i = 0; i < 4; ++i) As[buf][ak + i][ar] = ra[i];
#if GEMM_TRANS_B
#pragma unroll
    for (int i = 0; i < 4; ++i) Bs[buf][ak + i][ar] = rb[i];
#else
    *reinterpret_cast<float4*>(&Bs[buf][bk][bn]) = make_float4(rb[0], rb[1], rb[2], rb[3]);
#endif
  };

  float acc[8][8];
#pragma unroll
  for (int i = 0; i < 8; ++i)
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[i][j] = 0.f;

  int buf = 0;
  if (kb < ke) {
    gload(kb);
    sstore(0);
  }
  __syncthreads();
  for (int kt = kb; kt < ke; ++kt) {
    const bool more = kt + 1 < ke;
    if (more) gload(kt + 1);
#pragma unroll
    for (int k = 0; k < SBK; ++k) {
      const float4 a0 = *reinterpret_cast<const float4*>(&As[buf][k][4 * ty]);
      const float4 a1 = *reinterpret_cast<const float4*>(&As[buf][k][64 + 4 * ty]);
      const float4 b0 = *reinterpret_cast<const float4*>(&Bs[buf][k][4 * tx]);
      const float4 b1 = *reinterpret_cast<const float4*>(&Bs[buf][k][64 + 4 * tx]);
      const float av[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
      const float bv[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
#pragma unroll
      for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[i][j] = fmaf(av[i], bv[j], acc[i][j]);
    }
    if (more) sstore(buf ^ 1);
    __syncthreads();
    buf ^= 1;
  }

  const Epi e{alpha, beta, act, has_bias, has_beta};
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int row = m0 + (i < 4 ? 4 * ty + i : 64 + 4 * ty + (i - 4));
    if (row >= M) continue;
#pragma unroll
    for (int jh = 0; jh < 2; ++jh) {
      const int cb = n0 + jh * 64 + 4 * tx;
      if (splits > 1) {
        float* p = ws + (((size_t)sp * batch + bz) * M + row) * N;
#pragma unroll
        for (int j = 0; j < 4; ++j)
          if (cb + j < N) p[cb + j] = acc[i][4 * jh + j];
      } else {
        float* p = out + ((size_t)bz * M + row) * N;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int col = cb + j;
          if (col < N) {
            const float prev = has_beta ? p[col] : 0.f;
            const float bv = has_bias ? bias[col] : 0.f;
            p[col] = epi_apply(e, acc[i][4 * jh + j], prev, bv);
          }
        }
      }
    }
  }
}
