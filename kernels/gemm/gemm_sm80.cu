// Portable tensor-core GEMM (sm_80+): cp.async multistage pipeline, ldmatrix, mma.sync.
//
//   out[b, m, n] = act(alpha * sum_k a[b, m, k] * B[k, n] + beta * out_prev + bias[n])
//   a: (batch, M, K) row-major; B: (K, N) or (batch, K, N) row-major (b_bstride = 0 for 2-D);
//   GEMM_TRANS_B = 1: B given as (N, K) / (batch, N, K) and read as its transpose: its smem
//   tile is [BN][BK + pad] (k contiguous, like A) and fragments come from ldmatrix without
//   .trans (f16/bf16) or from the k-contiguous rows (tf32).
//
// GEMM_TF32 = 0: a, b, out 16-bit (f16 / bf16 per GEMM_BF16), mma m16n8k16, BK = 32.
// GEMM_TF32 = 1: a, b, out float32, operands rounded to tf32 (cvt.rna), mma m16n8k8, BK = 16.
// Block tile BM x 128 with BM = 64 * WARPS_M; each warp computes 64 x 32
// (4 m-fragments x 4 n-fragments). Any M, N, K: 16-byte cp.async when rows are
// 16-byte aligned (vec = 1), otherwise guarded scalar loads; tails masked.
// Split-K (splits > 1): blockIdx.z = batch * splits + split; float32 partials go to
// ws (splits, batch, M, N) and gemm_splitk_reduce applies the epilogue.
#include "gemm_common.cuh"

#ifndef GEMM_TF32
#define GEMM_TF32 0
#endif
#ifndef WARPS_M
#define WARPS_M 2
#endif
#ifndef GEMM_TRANS_B
#define GEMM_TRANS_B 0
#endif
#define BM (64 * WARPS_M)
#define BN 128
#define NTHREADS (128 * WARPS_M)
#define STAGES 3

#if GEMM_TF32
typedef float elem_t;
typedef float out_t;
#define BK 16
#define APAD 4
#define BPAD 8
#define EPC 4  // elements per 16-byte chunk
#else
typedef u16 elem_t;
typedef u16 out_t;
#define BK 32
#define APAD 8
#define BPAD 8
#define EPC 8
#endif
#define AROW (BK + APAD)
#define A_ELEMS (BM * AROW)
#if GEMM_TRANS_B
#define BROW (BK + APAD)
#define B_ELEMS (BN * BROW)
#else
#define BROW (BN + BPAD)
#define B_ELEMS (BK * BROW)
#endif

__device__ __forceinline__ float out_to_f(out_t x) {
#if GEMM_TF32
  return x;
#else
  return h2f(x);
#endif
}
__device__ __forceinline__ out_t f_to_out(float x) {
#if GEMM_TF32
  return x;
#else
  return f2h(x);
#endif
}
__device__ __forceinline__ elem_t zero_elem() { return (elem_t)0; }

extern "C" __global__ void __launch_bounds__(NTHREADS)
    gemm_sm80(const elem_t* __restrict__ A,  // (batch, M, K)
              const elem_t* __restrict__ B,  // (K, N) or (batch, K, N); trans: (N, K) or (batch, N, K)
              out_t* __restrict__ out,       // (batch, M, N)
              const out_t* __restrict__ bias, float* __restrict__ ws, int M, int N, int K, int batch,
              long long b_bstride, int splits, int kps, int vec, float alpha, float beta, int act,
              int has_bias, int has_beta) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  elem_t* sA = reinterpret_cast<elem_t*>(smem_raw);         // [STAGES][BM][AROW]
  elem_t* sB = sA + STAGES * A_ELEMS;                        // [STAGES][BK][BROW] or [STAGES][BN][BROW]
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int wm = warp / 4, wn = warp % 4;
  const int tn = blockIdx.x, tm = blockIdx.y;
  const int bz = blockIdx.z / splits, sp = blockIdx.z % splits;
  const int kt_total = (K + BK - 1) / BK;
  const int kb = sp * kps, ke = min(kt_total, kb + kps);
  const int nk = ke - kb;
  const elem_t* Ab = A + (size_t)bz * M * K;
  const elem_t* Bb = B + (size_t)bz * b_bstride;
  const int m0 = tm * BM, n0 = tn * BN;

  auto load_stage = [&](int st, int kt) {
    const int k0 = kt * BK;
    elem_t* a_s = sA + st * A_ELEMS;
    elem_t* b_s = sB + st * B_ELEMS;
    // A: BM rows x (BK / EPC) chunks
#pragma unroll
    for (int i = 0; i < (BM * BK / EPC) / NTHREADS; ++i) {
      const int ch = tid + i * NTHREADS;
      const int r = ch / (BK / EPC), cc = (ch % (BK / EPC)) * EPC;
      const int gr = m0 + r, gk = k0 + cc;
      elem_t* dst = a_s + r * AROW + cc;
      if (vec) {
        const bool ok = gr < M && gk < K;
        cp_async16(smem_u32(dst), ok ? (const void*)(Ab + (size_t)gr * K + gk) : (const void*)A, ok);
      } else {
#pragma unroll
        for (int e = 0; e < EPC; ++e)
          dst[e] = (gr < M && gk + e < K) ? Ab[(size_t)gr * K + gk + e] : zero_elem();
      }
    }
#if GEMM_TRANS_B
    // B (N, K): BN rows x (BK / EPC) chunks, like A
#pragma unroll
    for (int i = 0; i < (BN * BK / EPC) / NTHREADS; ++i) {
      const int ch = tid + i * NTHREADS;
      const int r = ch / (BK / EPC), cc = (ch % (BK / EPC)) * EPC;
      const int gn = n0 + r, gk = k0 + cc;
      elem_t* dst = b_s + r * BROW + cc;
      if (vec) {
        const bool ok = gn < N && gk < K;
        cp_async16(smem_u32(dst), ok ? (const void*)(Bb + (size_t)gn * K + gk) : (const void*)B, ok);
      } else {
#pragma unroll
        for (int e = 0; e < EPC; ++e)
          dst[e] = (gn < N && gk + e < K) ? Bb[(size_t)gn * K + gk + e] : zero_elem();
      }
    }
#else
    // B: BK rows x (BN / EPC) chunks
#pragma unroll
    for (int i = 0; i < (BK * BN / EPC) / NTHREADS; ++i) {
      const int ch = tid + i * NTHREADS;
      const int r = ch / (BN / EPC), cc = (ch % (BN / EPC)) * EPC;
      const int gk = k0 + r, gn = n0 + cc;
      elem_t* dst = b_s + r * BROW + cc;
      if (vec) {
        const bool ok = gk < K && gn < N;
        cp_async16(smem_u32(dst), ok ? (const void*)(Bb + (size_t)gk * N + gn) : (const void*)B, ok);
      } else {
#pragma unroll
        for (int e = 0; e < EPC; ++e)
          dst[e] = (gk < K && gn + e < N) ? Bb[(size_t)gk * N + gn + e] : zero_elem();
      }
    }
#endif
  };

  float acc[4][4][4];  // [m-frag][n-frag][c0..c3]
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int r = 0; r < 4; ++r) acc[i][j][r] = 0.f;

#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < nk) load_stage(s, kb + s);
    cp_async_commit();
  }

  for (int it = 0; it < nk; ++it) {
    cp_async_wait<STAGES - 2>();
    __syncthreads();
    if (it + STAGES - 1 < nk) load_stage((it + STAGES - 1) % STAGES, kb + it + STAGES - 1);
    cp_async_commit();
    const elem_t* a_s = sA + (it % STAGES) * A_ELEMS;
    const elem_t* b_s = sB + (it % STAGES) * B_ELEMS;
#if GEMM_TF32
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int kk = 0; kk < BK / 8; ++kk) {
      u32 af[4][4], bfr[4][2];
#pragma unroll
      for (int mi = 0; mi < 4; ++mi) {
        const float* p = a_s + (wm * 64 + mi * 16 + g) * AROW + kk * 8 + t;
        const float v[4] = {p[0], p[8 * AROW], p[4], p[8 * AROW + 4]};
#pragma unroll
        for (int q = 0; q < 4; ++q) asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(af[mi][q]) : "f"(v[q]));
      }
#pragma unroll
      for (int ni = 0; ni < 4; ++ni) {
#if GEMM_TRANS_B
        const float* p = b_s + (wn * 32 + ni * 8 + g) * BROW + kk * 8 + t;  // B[k][n] at [n][k]
        asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(bfr[ni][0]) : "f"(p[0]));
        asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(bfr[ni][1]) : "f"(p[4]));
#else
        const float* p = b_s + (kk * 8 + t) * BROW + wn * 32 + ni * 8 + g;
        asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(bfr[ni][0]) : "f"(p[0]));
        asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(bfr[ni][1]) : "f"(p[4 * BROW]));
#endif
      }
#pragma unroll
      for (int mi = 0; mi < 4; ++mi)
#pragma unroll
        for (int ni = 0; ni < 4; ++ni)
          asm volatile(
              "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
              "{%0,%1,%2,%3};\n"
              : "+f"(acc[mi][ni][0]), "+f"(acc[mi][ni][1]), "+f"(acc[mi][ni][2]), "+f"(acc[mi][ni][3])
              : "r"(af[mi][0]), "r"(af[mi][1]), "r"(af[mi][2]), "r"(af[mi][3]), "r"(bfr[ni][0]),
                "r"(bfr[ni][1]));
    }
#else
#pragma unroll
    for (int kk = 0; kk < BK / 16; ++kk) {
      u32 af[4][4], bfr[4][2];
#pragma unroll
      for (int mi = 0; mi < 4; ++mi) {
        const u32 addr = smem_u32(a_s + (wm * 64 + mi * 16 + (lane & 15)) * AROW + kk * 16 + (lane >> 4) * 8);
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                     : "=r"(af[mi][0]), "=r"(af[mi][1]), "=r"(af[mi][2]), "=r"(af[mi][3])
                     : "r"(addr));
      }
#pragma unroll
      for (int np = 0; np < 2; ++np) {
#if GEMM_TRANS_B
        // [n][k] tile: matrices (n 0-7, k 0-7), (n 0-7, k 8-15), (n 8-15, k 0-7), (n 8-15, k 8-15)
        const int nr = wn * 32 + np * 16 + (lane >> 4) * 8 + (lane & 7);
        const int kc = kk * 16 + ((lane >> 3) & 1) * 8;
        const u32 taddr = smem_u32(b_s + nr * BROW + kc);
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                     : "=r"(bfr[2 * np][0]), "=r"(bfr[2 * np][1]), "=r"(bfr[2 * np + 1][0]), "=r"(bfr[2 * np + 1][1])
                     : "r"(taddr));
        continue;
#endif
        const int kr = kk * 16 + ((lane >> 3) & 1) * 8 + (lane & 7);
        const int nc = wn * 32 + np * 16 + (lane >> 4) * 8;
        const u32 addr = smem_u32(b_s + kr * BROW + nc);
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                     : "=r"(bfr[2 * np][0]), "=r"(bfr[2 * np][1]), "=r"(bfr[2 * np + 1][0]), "=r"(bfr[2 * np + 1][1])
                     : "r"(addr));
      }
#pragma unroll
      for (int mi = 0; mi < 4; ++mi)
#pragma unroll
        for (int ni = 0; ni < 4; ++ni)
          mma16816(acc[mi][ni], af[mi][0], af[mi][1], af[mi][2], af[mi][3], bfr[ni][0], bfr[ni][1]);
    }
#endif
  }
  cp_async_wait<0>();

  // ---- epilogue: c0,c1 at (row g, cols 2t, 2t+1), c2,c3 at row g + 8 ----
  const Epi e{alpha, beta, act, has_bias, has_beta};
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int mi = 0; mi < 4; ++mi) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = m0 + wm * 64 + mi * 16 + g + 8 * h;
      if (row >= M) continue;
#pragma unroll
      for (int ni = 0; ni < 4; ++ni) {
#pragma unroll
        for (int q = 0; q < 2; ++q) {
          const int col = n0 + wn * 32 + ni * 8 + 2 * t + q;
          if (col >= N) continue;
          const float v = acc[mi][ni][2 * h + q];
          if (splits > 1) {
            ws[(((size_t)sp * batch + bz) * M + row) * N + col] = v;
          } else {
            out_t* p = out + ((size_t)bz * M + row) * N + col;
            const float prev = has_beta ? out_to_f(*p) : 0.f;
            const float bv = has_bias ? out_to_f(bias[col]) : 0.f;
            *p = f_to_out(epi_apply(e, v, prev, bv));
          }
        }
      }
    }
  }
}
