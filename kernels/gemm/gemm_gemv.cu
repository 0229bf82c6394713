// Skinny GEMM with b given (K, N) (M <= 8 rows, decode), 16-bit in/out, float32 accumulation,
// CUDA cores. Memory bound: B is read once, in whole 256-byte row segments.
//
//   out[b, m, n] = act(alpha * sum_k a[b, m, k] * B[k, n] + beta * out_prev + bias[n]),  m < M <= 8
//   a: (batch, M, K); B: (K, N) or (batch, K, N) (b_bstride = 0 for 2-D); N % 8 == 0 and
//   16-byte aligned B rows (host checks). Compiled per GV_MR >= M (registers scale with it).
//
// Grid: x = strips of GV_COLS = 8 GV_LPR columns of N, y = GV_CL slices of K (one thread-block
// cluster), z = batch. Block: 256 threads = GV_HW row groups of GV_LPR lanes; a row group reads
// 16 GV_LPR contiguous bytes of one row of B (8 columns per lane, one 16-byte load each) and
// takes runs of 8 consecutive rows (k = k0 + 8 g + 8 GV_HW i + u, u < 8): 8 independent
// 16-byte loads of B in flight per thread (16 with GV_PF), and a[m, k .. k+7] as one 16-byte
// load when K % 8 == 0.
// Reduction: the row groups of a warp by shuffle, the 8 warps through shared memory, then
// the GV_CL blocks of the cluster through distributed shared memory (sm_90): block rank q
// sums every GV_CL-th output of the strip over the ranks in rank order (deterministic) and
// applies the epilogue. One launch, no workspace. GV_CL = 1 (other GPUs): no cluster.
#include "gemm_common.cuh"

#ifndef GV_CL
#define GV_CL 1
#endif
#ifndef GV_MR  // rows compiled for (1, 2, 4 or 8; the call's M <= GV_MR)
#define GV_MR 8
#endif
#ifndef GV_LPR  // lanes reading one row segment (8 or 16: 128 or 256 contiguous bytes)
#define GV_LPR 16
#endif
#ifndef GV_PF  // 1: the next step's rows of B are loaded while this step's are summed
#define GV_PF 0
#endif
#define GV_COLS (GV_LPR * 8)  // columns per strip
#define GV_HW (256 / GV_LPR)  // row groups per block
#define GV_U 8                // consecutive rows per row-group step

#if GV_CL > 1
#define GV_CLUSTER_ATTR __cluster_dims__(1, GV_CL, 1)
#else
#define GV_CLUSTER_ATTR
#endif

__device__ __forceinline__ void cluster_sync_all() {
#if GV_CL > 1
  cluster_barrier();
#endif
}

// part[] of cluster block `rank` (rank == own rank: a plain shared load).
__device__ __forceinline__ float ld_rank(const float* p, u32 rank) {
#if GV_CL > 1
  return ld_cluster_f32(p, rank);
#else
  return *p;
#endif
}

__device__ __forceinline__ void unpack8(const uint4& v, float (&f)[8]) {
  const u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    f[2 * q] = h2f((u16)(w[q] & 0xFFFFu));
    f[2 * q + 1] = h2f((u16)(w[q] >> 16));
  }
}

extern "C" __global__ void __launch_bounds__(256) GV_CLUSTER_ATTR
    gemm_gemv(const u16* __restrict__ A, const u16* __restrict__ B, u16* __restrict__ out,
              const u16* __restrict__ bias, int M, int N, int K, long long b_bstride, float alpha, float beta,
              int act, int has_bias, int has_beta, int a_vec) {
  __shared__ float red[8][GV_MR][GV_COLS];     // [warp][row][col] (4 KiB per row)
  __shared__ float part[GV_MR][GV_COLS];      // this block's sums [row][col]
  pdl_wait();  // launched with programmatic dependent launch on sm_90: the inputs' producer
  pdl_launch_dependents();
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int hw = tid / GV_LPR, l16 = tid % GV_LPR;
  const int bz = blockIdx.z, slice = blockIdx.y;
  const int n0 = blockIdx.x * GV_COLS;
  const int col = n0 + l16 * 8;
  const bool col_ok = col < N;
  const u16* Ab = A + (size_t)bz * M * K;
  const u16* Bb = B + (size_t)bz * b_bstride;

  // this block's K range: GV_CL slices of a multiple of 8 rows
  const int kc = ((K + GV_CL - 1) / GV_CL + 7) / 8 * 8;
  const int kbeg = slice * kc, kend = min(K, kbeg + kc);

  float acc[GV_MR][8];  // [row][col]
#pragma unroll
  for (int r = 0; r < GV_MR; ++r)
#pragma unroll
    for (int c = 0; c < 8; ++c) acc[r][c] = 0.f;

  auto load_b = [&](int k, uint4 (&v)[GV_U]) {
#pragma unroll
    for (int u = 0; u < GV_U; ++u)
      v[u] = (col_ok && k + u < kend) ? __ldg(reinterpret_cast<const uint4*>(Bb + (size_t)(k + u) * N + col))
                                      : make_uint4(0u, 0u, 0u, 0u);
  };
  uint4 v[GV_U];
#if GV_PF
  load_b(kbeg + hw * GV_U, v);
#endif
  for (int k = kbeg + hw * GV_U; k < kend; k += GV_HW * GV_U) {
#if GV_PF
    uint4 vc[GV_U];
#pragma unroll
    for (int u = 0; u < GV_U; ++u) vc[u] = v[u];
    load_b(k + GV_HW * GV_U, v);  // the next step (zeros past kend)
#else
    uint4 vc[GV_U];
    load_b(k, vc);
#endif
    float av[GV_MR][GV_U];  // [row][u]
#pragma unroll
    for (int r = 0; r < GV_MR; ++r) {
      if (r < M) {
        if (a_vec && k + GV_U <= kend) {
          unpack8(__ldg(reinterpret_cast<const uint4*>(Ab + (size_t)r * K + k)), av[r]);
        } else {
#pragma unroll
          for (int u = 0; u < GV_U; ++u) av[r][u] = k + u < kend ? h2f(Ab[(size_t)r * K + k + u]) : 0.f;
        }
      }
    }
#pragma unroll
    for (int u = 0; u < GV_U; ++u) {
      float bf[8];
      unpack8(vc[u], bf);
#pragma unroll
      for (int r = 0; r < GV_MR; ++r) {
        if (r < M) {
#pragma unroll
          for (int c = 0; c < 8; ++c) acc[r][c] = fmaf(av[r][u], bf[c], acc[r][c]);
        }
      }
    }
  }
  // lanes l, l + GV_LPR, ... of a warp hold the same columns
#pragma unroll
  for (int r = 0; r < GV_MR; ++r) {
    if (r >= M) break;  // uniform
#pragma unroll
    for (int c = 0; c < 8; ++c)
#pragma unroll
      for (int o = GV_LPR; o < 32; o <<= 1) acc[r][c] += __shfl_xor_sync(0xffffffffu, acc[r][c], o);
  }
  if (lane < GV_LPR) {
#pragma unroll
    for (int r = 0; r < GV_MR; ++r) {
      if (r >= M) break;
#pragma unroll
      for (int c = 0; c < 8; ++c) red[warp][r][l16 * 8 + c] = acc[r][c];
    }
  }
  __syncthreads();
  for (int idx = tid; idx < M * GV_COLS; idx += 256) {
    const int r = idx / GV_COLS, c = idx % GV_COLS;
    float s = 0.f;
#pragma unroll
    for (int w = 0; w < 8; ++w) s += red[w][r][c];
    part[r][c] = s;
  }
  __syncthreads();
  cluster_sync_all();  // every block's part[] is complete (and visible cluster-wide)

  const Epi e{alpha, beta, act, has_bias, has_beta};
  for (int idx = slice + GV_CL * tid; idx < M * GV_COLS; idx += GV_CL * 256) {
    const int r = idx / GV_COLS, c = idx % GV_COLS;
    const int oc = n0 + c;
    float s = 0.f;
#pragma unroll
    for (int q = 0; q < GV_CL; ++q) s += ld_rank(&part[r][c], (u32)q);
    if (oc < N) {
      u16* p = out + ((size_t)bz * M + r) * N + oc;
      const float prev = has_beta ? h2f(*p) : 0.f;
      const float bv = has_bias ? h2f(bias[oc]) : 0.f;
      *p = f2h(epi_apply(e, s, prev, bv));
    }
  }
  cluster_sync_all();  // no block exits while another still reads its part[]
}
