// Skinny GEMM (M <= 8 rows, decode), 16-bit in/out, float32 accumulation, CUDA cores.
// The problem is memory bound (B is read once), so each block streams a 32-column strip
// of B over all of K with 16-byte loads and no split-K round trip:
//
//   out[b, m, n] = act(alpha * sum_k a[b, m, k] * B[k, n] + beta * out_prev + bias[n]),  m < M <= 8
//   a: (batch, M, K); B: (K, N) or (batch, K, N) (b_bstride = 0 for 2-D); N % 8 == 0 and
//   16-byte aligned rows (host checks).
//
// Block: 256 threads = 128 k-groups x 2 column groups of 8 columns (a 16-column strip).
// Thread (kg, cg) sums k = kg, kg + 128, ... for its 8 columns and all M rows (acc[8][8]),
// with 8 independent 16-byte loads in flight; warp shuffles reduce the 16 k-groups of a
// warp, shared memory the 8 warps; then 8 rows x 16 columns of threads apply the epilogue.
#include "gemm_common.cuh"

#define GV_COLS 16
#define GV_KG 128
#define GV_UNROLL 8

extern "C" __global__ void __launch_bounds__(256)
    gemm_gemv(const u16* __restrict__ A, const u16* __restrict__ B, u16* __restrict__ out,
              const u16* __restrict__ bias, int M, int N, int K, long long b_bstride, float alpha, float beta,
              int act, int has_bias, int has_beta) {
  __shared__ float red[8][8][GV_COLS];  // [warp][row][col]
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int cg = tid & 1, kg = tid >> 1;
  const int bz = blockIdx.z;
  const int n0 = blockIdx.x * GV_COLS;
  const int col = n0 + cg * 8;
  const u16* Ab = A + (size_t)bz * M * K;
  const u16* Bb = B + (size_t)bz * b_bstride;

  float acc[8][8];
#pragma unroll
  for (int r = 0; r < 8; ++r)
#pragma unroll
    for (int c = 0; c < 8; ++c) acc[r][c] = 0.f;

  if (col < N) {
    // GV_UNROLL independent (predicated) 16-byte loads in flight per thread
    for (int k = kg; k < K; k += GV_UNROLL * GV_KG) {
      uint4 v[GV_UNROLL];
      float av[GV_UNROLL][8];
#pragma unroll
      for (int u = 0; u < GV_UNROLL; ++u) {
        const int ku = k + u * GV_KG;
        v[u] = ku < K ? __ldg(reinterpret_cast<const uint4*>(Bb + (size_t)ku * N + col)) : make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
        for (int r = 0; r < 8; ++r) av[u][r] = (r < M && ku < K) ? h2f(Ab[(size_t)r * K + ku]) : 0.f;
      }
#pragma unroll
      for (int u = 0; u < GV_UNROLL; ++u) {
        const u32 w[4] = {v[u].x, v[u].y, v[u].z, v[u].w};
        float bf[8];
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          bf[2 * q] = h2f((u16)(w[q] & 0xFFFFu));
          bf[2 * q + 1] = h2f((u16)(w[q] >> 16));
        }
#pragma unroll
        for (int r = 0; r < 8; ++r) {
          if (r < M) {
#pragma unroll
            for (int c = 0; c < 8; ++c) acc[r][c] = fmaf(av[u][r], bf[c], acc[r][c]);
          }
        }
      }
    }
  }
  // reduce the 16 k-groups of this warp (lanes differing in bits 1..4)
#pragma unroll
  for (int r = 0; r < 8; ++r) {
    if (r >= M) break;  // uniform: only live rows are reduced
#pragma unroll
    for (int c = 0; c < 8; ++c) {
      float x = acc[r][c];
      x += __shfl_xor_sync(0xffffffffu, x, 2);
      x += __shfl_xor_sync(0xffffffffu, x, 4);
      x += __shfl_xor_sync(0xffffffffu, x, 8);
      x += __shfl_xor_sync(0xffffffffu, x, 16);
      acc[r][c] = x;
    }
  }
  if (lane < 2) {
#pragma unroll
    for (int r = 0; r < 8; ++r) {
      if (r >= M) break;
#pragma unroll
      for (int c = 0; c < 8; ++c) red[warp][r][lane * 8 + c] = acc[r][c];
    }
  }
  __syncthreads();
  // threads 0..127 = 8 rows x 16 columns
  const int r = tid >> 4, cc = tid & 15;
  const int oc = n0 + cc;
  if (tid < 128 && r < M && oc < N) {
    float s = 0.f;
#pragma unroll
    for (int w = 0; w < 8; ++w) s += red[w][r][cc];
    const Epi e{alpha, beta, act, has_bias, has_beta};
    u16* p = out + ((size_t)bz * M + r) * N + oc;
    const float prev = has_beta ? h2f(*p) : 0.f;
    const float bv = has_bias ? h2f(bias[oc]) : 0.f;
    *p = f2h(epi_apply(e, s, prev, bv));
  }
}
