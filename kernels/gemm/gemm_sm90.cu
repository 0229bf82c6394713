// Hopper (sm_90a) GEMM: TMA + mbarrier pipeline, warp-specialized, persistent.
//
//   out[b, m, n] = act(alpha * sum_k a[b, m, k] * B[k, n] + beta * out_prev + bias[n])
//   a: (batch, M, K) row-major, B: (K, N) or (batch, K, N) row-major (GEMM_TRANS_B = 1:
//   (N, K) or (batch, N, K), read as its transpose), 16-bit (f16 / bf16),
//   float32 accumulation in registers (wgmma), output 16-bit, or float32 split-K partials.
//
// Block = 1 producer warpgroup (one thread issues TMA) + NCW consumer warpgroups.
// Block tile BM x BN = (64 * NCW) x BN, k-tile BK = 64, STAGES-deep smem ring:
//   stage s: A tile [BM][64] (K-major, 128B swizzle: one 128-byte row per m)
//            B tile [BN/64][64 k][64 n] (MN-major, 128B swizzle: one 128-byte row per k)
// Consumer warpgroup c owns rows [64c, 64c + 64) of the tile: wgmma m64nBNk16, A and B
// from shared memory. full[s] (tx-count) says a stage landed; empty[s] (one arrive per
// consumer warp) says it may be overwritten. The grid is persistent: block i does tiles
// i, i + gridDim.x, ... in grouped (L2-friendly) order; the producer runs ahead into the
// next tile while consumers run the epilogue.
//
// Programmatic dependent launch (the host launches with the attribute on sm_90): every
// thread waits for the previous grid (pdl_wait) after the shared-memory set-up and before
// any global access, and the next grid may begin launching at once.
//
// TMA needs 16-byte aligned row strides: K % 8 == 0 and N % 8 == 0 (host checks); M, N, K
// tails are zero-filled by TMA and masked in the epilogue.
#include "gemm_common.cuh"
#include "gemm_wgmma.cuh"

#ifndef BN
#define BN 256
#endif
#ifndef NCW
#define NCW 2
#endif
#ifndef STAGES
#define STAGES 4
#endif
#ifndef GROUP_M
#define GROUP_M 8
#endif
// GEMM_EPI_PLAIN = 1: alpha == 1, beta == 0, no bias, no activation (the host checks):
// the epilogue only converts and stores.
#define BM (64 * NCW)
#include "gemm_sm90_common.cuh"

// ---- GEMM_EPI_TMA = 1 (one K slice, beta == 0; the host checks): the epilogue stores through
// shared memory and TMA. Each consumer warpgroup owns two 64 x 64 staging boxes (8 KB each,
// 128B swizzle: the 16-byte chunk `ch` of row r sits at chunk ch ^ (r % 8), so the fragment
// writes are free of bank conflicts); it fills one box per 64 columns of its 64 x BN rows and
// one thread stores it (cp.async.bulk.tensor; rows past M / columns past N are clipped by
// TMA), alternating the boxes: a box is refilled once the store two boxes back has read it.
#ifndef GEMM_EPI_TMA
#define GEMM_EPI_TMA 0
#endif
#define EPI_WG_BYTES (2 * 8192)
#define EPI_BYTES (GEMM_EPI_TMA ? NCW * EPI_WG_BYTES : 0)

__device__ __forceinline__ void tma_store3(const TmaDesc* tm, u32 src, int c0, int c1, int c2) {
  asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%2, %3, %4}], [%1];" ::"l"(tm),
               "r"(src), "r"(c0), "r"(c1), "r"(c2)
               : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
// at most one bulk store group of this thread still reading shared memory
__device__ __forceinline__ void bulk_wait_read1() { asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory"); }
__device__ __forceinline__ void bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }

// Consumer warpgroup epilogue: rows [row0, row0 + 64) x columns [col0, col0 + BN) of batch bz
// from the accumulators d (thread: rows r, r + 8 and column pairs 8j + 2(lane % 4)), with
// alpha, bias and the activation applied; `stg`: this warpgroup's two staging boxes; `tid`:
// the thread's index in consumer warpgroup c (named barrier 1 + c per box).
__device__ __forceinline__ void epilogue_tma(const float (&d)[NACC], const Epi& e, const TmaDesc* tmC, u32 stg,
                                             const u16* __restrict__ bias, int row0, int col0, int bz, int N,
                                             int c, int tid) {
  const int lane = tid & 31;
  const int r = (tid >> 5) * 16 + (lane >> 2);  // row in the warpgroup's 64; r % 8 == lane / 4
  const int bar = 1 + c;                         // this warpgroup's named barrier
#pragma unroll
  for (int q = 0; q < BN / 64; ++q) {
    const u32 box = stg + (q & 1) * 8192;
    if (tid == 0) bulk_wait_read1();
    named_sync(bar, 128);  // the box is free
#pragma unroll
    for (int jj = 0; jj < 8; ++jj) {
      const int j = 8 * q + jj;
      float v[4];
#if GEMM_EPI_PLAIN
#pragma unroll
      for (int i = 0; i < 4; ++i) v[i] = d[4 * j + i];
#else
      const int col = col0 + 8 * j + 2 * (lane & 3);
      float b0 = 0.f, b1 = 0.f;
      if (e.has_bias && col < N) {
        const u32 bb = *reinterpret_cast<const u32*>(bias + col);
        b0 = h2f((u16)(bb & 0xFFFFu));
        b1 = h2f((u16)(bb >> 16));
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        v[2 * h] = epi_apply(e, d[4 * j + 2 * h], 0.f, b0);
        v[2 * h + 1] = epi_apply(e, d[4 * j + 2 * h + 1], 0.f, b1);
      }
#endif
      const u32 off = (u32)((jj ^ (lane >> 2)) << 4) + ((lane & 3) << 2);
      asm volatile("st.shared.u32 [%0], %1;" ::"r"(box + r * 128 + off), "r"(pack2(v[0], v[1])) : "memory");
      asm volatile("st.shared.u32 [%0], %1;" ::"r"(box + (r + 8) * 128 + off), "r"(pack2(v[2], v[3])) : "memory");
    }
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // generic writes -> the TMA engine
    named_sync(bar, 128);
    if (tid == 0) {
      tma_store3(tmC, box, col0 + 64 * q, row0, bz);
      bulk_commit();
    }
  }
}

extern "C" __global__ void __launch_bounds__(NTHREADS, 1)
    gemm_sm90(const __grid_constant__ TmaDesc tmA,  // a as (K, M, batch) [inner first]
              const __grid_constant__ TmaDesc tmB,  // b as (N, K, batch_b); trans: (K, N, batch_b)
              const __grid_constant__ TmaDesc tmC,  // out as (N, M, batch), 64 x 64 boxes (GEMM_EPI_TMA)
              u16* __restrict__ out,                // (batch, M, N)
              const u16* __restrict__ bias,         // (N,) or null
              float* __restrict__ ws,               // (splits, batch, M, N) float32 when splits > 1
              int M, int N, int batch, int tiles_m, int tiles_n, int splits, int kt_total, int kps, int b_batched,
              int total_tiles, float alpha, float beta, int act, int has_bias, int has_beta) {
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const u32 base = (smem_u32(smem_raw) + 1023u) & ~1023u;
  const u32 stage_out = base + STAGES * STAGE_BYTES;  // EPI_BYTES: output staging (GEMM_EPI_TMA)
  const u32 full = stage_out + EPI_BYTES;               // STAGES x u64
  const u32 empty = full + STAGES * 8;           // STAGES x u64
  const int wg = threadIdx.x >> 7;
  const int tid = threadIdx.x & 127;

  ring_start(full, empty, &tmA, &tmB);

  if (wg == 0) {
    // ---------------- producer ----------------
#if NCW == 2
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
#endif
    if (tid == 0) {
      int it = 0;
      for (int t = (int)blockIdx.x; t < total_tiles; t += (int)gridDim.x) {
        int bz, sp, tm, tn;
        decode_tile(t, tiles_m, tiles_n, splits, bz, sp, tm, tn);
        const int kb = sp * kps;
        const int ke = min(kt_total, kb + kps);
        const int bzb = b_batched ? bz : 0;
        for (int kt = kb; kt < ke; ++kt, ++it) {
          const u32 sa = ring_acquire(base, full, empty, it);
          const u32 sb = sa + A_BYTES;
          const u32 fb = full + 8 * (it % STAGES);
          tma_load3(sa, &tmA, fb, kt * BK, tm * BM, bz);
#if   GEMM_TRANS_B
          tma_load3(sb, &tmB, fb, kt * BK, tn * BN, bzb);  // [BN][64 k], like A
#else
#pragma unroll
          for (int j = 0; j < BN / 64; ++j) tma_load3(sb + j * (BK * 128), &tmB, fb, tn * BN + 64 * j, kt * BK, bzb);
#endif
        }
      }
    }
  } else {
    // ---------------- consumers ----------------
#if NCW == 2
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n");
#endif
    const int c = wg - 1;
    const int warp = tid >> 5, lane = tid & 31;
    const Epi e{alpha, beta, act, has_bias, has_beta};
    int it = 0;
    float d[NACC];
    for (int t = (int)blockIdx.x; t < total_tiles; t += (int)gridDim.x) {
      int bz, sp, tm, tn;
      decode_tile(t, tiles_m, tiles_n, splits, bz, sp, tm, tn);
      const int kb = sp * kps;
      const int ke = min(kt_total, kb + kps);
#pragma unroll
      for (int i = 0; i < NACC; ++i) d[i] = 0.f;
      int prev = -1;
      for (int kt = kb; kt < ke; ++kt, ++it) ring_mma(d, base, full, empty, c, it, prev, lane);
      wgmma_wait<0>();
      fence_regs(d);
      if (prev >= 0) {
        __syncwarp();
        ring_release(empty + 8 * prev, lane);
      }

#if GEMM_EPI_TMA
      epilogue_tma(d, e, &tmC, stage_out + c * EPI_WG_BYTES, bias, tm * BM + c * 64, tn * BN, bz, N, c, tid);
      continue;
#endif
      // ---- epilogue: thread holds rows r0, r0 + 8 and column pairs 8j + 2(lane % 4) ----
      const int r0 = tm * BM + c * 64 + warp * 16 + (lane >> 2);
      const int cb = tn * BN + 2 * (lane & 3);
      if (splits > 1) {
        const size_t slab = ((size_t)sp * batch + bz) * (size_t)M * N;
#pragma unroll
        for (int j = 0; j < NACC / 4; ++j) {
          const int col = cb + 8 * j;
          if (col >= N) continue;
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int row = r0 + 8 * h;
            if (row < M) {
              *reinterpret_cast<float2*>(ws + slab + (size_t)row * N + col) = make_float2(d[4 * j + 2 * h], d[4 * j + 2 * h + 1]);
            }
          }
        }
      } else {
        u16* op = out + (size_t)bz * M * N;
#pragma unroll
        for (int j = 0; j < NACC / 4; ++j) {
          const int col = cb + 8 * j;
          if (col >= N) continue;
#if GEMM_EPI_PLAIN
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int row = r0 + 8 * h;
            if (row < M)
              *reinterpret_cast<u32*>(op + (size_t)row * N + col) = pack2(d[4 * j + 2 * h], d[4 * j + 2 * h + 1]);
          }
          continue;
#endif
          float b0 = 0.f, b1 = 0.f;
          if (has_bias) {
            const u32 bb = *reinterpret_cast<const u32*>(bias + col);
            b0 = h2f((u16)(bb & 0xFFFFu));
            b1 = h2f((u16)(bb >> 16));
          }
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int row = r0 + 8 * h;
            if (row < M) {
              u32* p = reinterpret_cast<u32*>(op + (size_t)row * N + col);
              float p0 = 0.f, p1 = 0.f;
              if (has_beta) {
                const u32 pv = *p;
                p0 = h2f((u16)(pv & 0xFFFFu));
                p1 = h2f((u16)(pv >> 16));
              }
              *p = pack2(epi_apply(e, d[4 * j + 2 * h], p0, b0), epi_apply(e, d[4 * j + 2 * h + 1], p1, b1));
            }
          }
        }
      }
    }
#if GEMM_EPI_TMA
    if (tid == 0) bulk_wait_all();  // the shared staging must outlive its last store
#endif
  }
}
