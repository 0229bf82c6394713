// Skinny GEMM on Hopper tensor cores with the operands swapped (sm_90a), for 17..64 rows
// and large weights given (N, K) (trans_b), f16/bf16, float32 accumulation:
//
//   out[b, m, n] = act(alpha * sum_k a[b, m, k] * W[(b,) n, k] + beta * out_prev + bias[n])
//
// computed as out^T = W a^T: the weight is the wgmma A operand (BM = 64 * NCW rows a block,
// K-major, TMA 128B-swizzled tiles of 64 k), the activation the B operand (BN = 8 * ceil(M / 8)
// padded rows, K-major, zero-filled past M by TMA). The weight streams through a STAGES-deep
// TMA ring (full/empty mbarriers, one producer thread), so many bytes are in flight per SM
// without registers; every block reads the activation tiles of its K slice once for BM
// weight rows.
//
// Grid: x = tiles of BM weight rows, y = SW_CL K slices of kps k-tiles (one thread-block
// cluster), z = batch. After its K slice each block writes its partial tile red[m][row]
// (float32) to shared memory; after a cluster barrier block rank q sums rows
// [q * BM / SW_CL, ...) over the ranks in rank order (distributed shared memory,
// deterministic), applies the epilogue and stores out[b, m, n] (consecutive threads:
// consecutive n). One launch, no workspace. Host checks: K % 8 == 0, 16-byte aligned a / W.
//
// Activation multicast (SW_MC = 2 or 4, only with SW_CL = 1 and not persistent): SW_MC blocks
// of consecutive weight tiles form a cluster along x; each loads BN / SW_MC rows of every
// activation k-tile and multicasts them to all, so the L2 -> SM traffic of the activation is
// divided by SW_MC; a stage is free once the consumers of every block of the cluster are done
// with it (RING_PEERS = SW_MC: each consumer warp arrives on every block's empty barrier).
//
// Persistent (SW_PERSIST = 1, only with SW_CL = 1, for weights of more tiles than one wave):
// grid x is a number of blocks that each take an equal count of tiles (tile = blockIdx.x +
// i * gridDim.x); the producer streams every k-tile of every tile of its block through one
// ring without a gap between tiles, and each consumer warpgroup finishes a tile on its own
// (its 64 rows of red[], a named barrier per warpgroup) while the ring keeps filling.
#include "gemm_common.cuh"
#include "gemm_wgmma.cuh"

// The host passes every geometry define (kernels/gemm/_cuda.py, _build_skinny_tma).
#if !defined(BN) || !defined(NCW) || !defined(STAGES) || !defined(SW_CL)
#error "gemm_skinny_tma.cu: compile with -DBN= -DNCW= -DSTAGES= -DSW_CL="
#endif
#define BM (64 * NCW)
#define GROUP_M 8  // unused here (the header's tile-order decode needs it)
#ifndef SW_MC
#define SW_MC 1
#endif
#define RING_PEERS SW_MC
#include "gemm_sm90_common.cuh"
#define SW_RP (BM + 4)  // red[] row pitch (floats): lanes of one store fall in distinct banks

#ifndef SW_PERSIST
#define SW_PERSIST 0
#endif
#if SW_PERSIST && SW_CL != 1
#error "gemm_skinny_tma.cu: SW_PERSIST needs SW_CL = 1"
#endif

#if SW_MC > 1 && (SW_CL != 1 || SW_PERSIST || BN % (8 * SW_MC) != 0)
#error "gemm_skinny_tma.cu: SW_MC needs SW_CL = 1, no SW_PERSIST, and BN / SW_MC a multiple of 8 rows"
#endif

#if SW_MC > 1
#define SW_CLUSTER_ATTR __cluster_dims__(SW_MC, 1, 1)
#elif SW_CL > 1
#define SW_CLUSTER_ATTR __cluster_dims__(1, SW_CL, 1)
#else
#define SW_CLUSTER_ATTR
#endif

// Consumer warpgroup c's accumulators into its 64 rows of red[m][row]: accumulator i of a
// lane is weight row 64c + 16 warp + lane / 4 + 8 ((i / 2) % 2) and activation row
// m = 8 (i / 4) + 2 (lane % 4) + i % 2.
__device__ __forceinline__ void acc_to_red(const float (&d)[NACC], float* red, int c, int tid) {
  const int lane = tid & 31, warp = tid >> 5;
#pragma unroll
  for (int i = 0; i < NACC; ++i) {
    const int r = 64 * c + 16 * warp + (lane >> 2) + 8 * ((i >> 1) & 1);
    const int m = 8 * (i >> 2) + 2 * (lane & 3) + (i & 1);
    red[m * SW_RP + r] = d[i];
  }
}

#if SW_PERSIST
// Barrier of consumer warpgroup c's 128 threads (named barrier 1 + c, a compile-time id).
__device__ __forceinline__ void wg_sync(int c) {
  if (c == 0)
    asm volatile("bar.sync 1, 128;" ::: "memory");
  else
    asm volatile("bar.sync 2, 128;" ::: "memory");
}

// The persistent body (see the header): tiles blockIdx.x, + gridDim.x, ... of batch blockIdx.z.
__device__ __forceinline__ void persistent_tiles(const TmaDesc& tmX, const TmaDesc& tmW, u16* __restrict__ out,
                                                 const u16* __restrict__ bias, u32 base, u32 full, u32 empty,
                                                 float* red, int M, int N, int kt_total, int b_batched,
                                                 const Epi& e) {
  const int wg = threadIdx.x >> 7, tid = threadIdx.x & 127, bz = blockIdx.z;
  const int ntiles = (N + BM - 1) / BM;
  if (wg == 0) {
    if (tid == 0) {  // producer: every k-tile of every tile, one ring sequence
      const int bw = b_batched ? bz : 0;
      int it = 0;
      for (int tile = blockIdx.x; tile < ntiles; tile += gridDim.x)
        for (int kt = 0; kt < kt_total; ++kt, ++it) {
          const u32 sa = ring_acquire(base, full, empty, it), fb = full + 8 * (it % STAGES);
          tma_load3(sa, &tmW, fb, kt * BK, tile * BM, bw);  // [BM][64 k]
          tma_load3(sa + A_BYTES, &tmX, fb, kt * BK, 0, bz);  // [BN][64 k]
        }
    }
    return;  // no block-wide barrier follows
  }
  const int c = wg - 1, lane = tid & 31;
  int it = 0, prev = -1;
  for (int tile = blockIdx.x; tile < ntiles; tile += gridDim.x) {
    float d[NACC];
#pragma unroll
    for (int i = 0; i < NACC; ++i) d[i] = 0.f;
    for (int kt = 0; kt < kt_total; ++kt, ++it) ring_mma(d, base, full, empty, c, it, prev, lane);
    wgmma_wait<0>();
    fence_regs(d);
    __syncwarp();
    ring_release(empty + 8 * prev, lane);  // the tile's last stage: free it before the epilogue
    prev = -1;
    wg_sync(c);  // this warpgroup's reads of red[] for the previous tile are done
    acc_to_red(d, red, c, tid);
    wg_sync(c);
    for (int i = tid; i < M * 64; i += 128) {  // rows [64c, 64c + 64): 128 consecutive bytes of out
      const int m = i >> 6, r = 64 * c + (i & 63);
      const int n = tile * BM + r;
      if (n < N) {
        u16* p = out + ((size_t)bz * M + m) * N + n;
        const float prev_v = e.has_beta ? h2f(*p) : 0.f;
        const float bv = e.has_bias ? h2f(bias[n]) : 0.f;
        *p = f2h(epi_apply(e, red[m * SW_RP + r], prev_v, bv));
      }
    }
  }
}
#endif

extern "C" __global__ void __launch_bounds__(NTHREADS, 1) SW_CLUSTER_ATTR
    gemm_skinny_tma(const __grid_constant__ TmaDesc tmX,  // a as (K, M, batch) [inner first]
                    const __grid_constant__ TmaDesc tmW,  // W as (K, N, batch_w)
                    u16* __restrict__ out,                // (batch, M, N)
                    const u16* __restrict__ bias,         // (N,) or null
                    float* __restrict__ unused_ws,        // (the sm_90 launcher's fifth pointer)
                    int M, int N, int kt_total, int kps, int b_batched,
                    float alpha, float beta, int act, int has_bias, int has_beta) {
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const u32 base = (smem_u32(smem_raw) + 1023u) & ~1023u;
  const u32 full = base + STAGES * STAGE_BYTES;  // STAGES x u64
  const u32 empty = full + STAGES * 8;           // STAGES x u64
  float* red = reinterpret_cast<float*>(smem_raw + (base - smem_u32(smem_raw)) + STAGES * STAGE_BYTES + 16 * STAGES);
  ring_start(full, empty, &tmW, &tmX);  // RING_PEERS = SW_MC: every peer's barriers too
#if SW_PERSIST
  persistent_tiles(tmX, tmW, out, bias, base, full, empty, red, M, N, kt_total, b_batched,
                   Epi{alpha, beta, act, has_bias, has_beta});
#else
  const int wg = threadIdx.x >> 7, tid = threadIdx.x & 127;
  const int tile = blockIdx.x, q = blockIdx.y, bz = blockIdx.z;
  const int kb = q * kps, ke = min(kt_total, kb + kps);
  float d[NACC];
#pragma unroll
  for (int i = 0; i < NACC; ++i) d[i] = 0.f;
  if (wg == 0) {
    // ---------------- producer: one thread issues the TMA loads ----------------
    if (tid == 0) {
      const int bw = b_batched ? bz : 0;
      for (int kt = kb, it = 0; kt < ke; ++kt, ++it) {
        const u32 sa = ring_acquire(base, full, empty, it), fb = full + 8 * (it % STAGES);
        tma_load3(sa, &tmW, fb, kt * BK, tile * BM, bw);        // [BM][64 k]
#if SW_MC > 1
        {  // this block's BN / SW_MC rows of the activation tile, multicast to the cluster
          constexpr int kRows = BN / SW_MC;
          const int rank = (int)cluster_rank();
          tma_load3_mc(sa + A_BYTES + rank * (kRows * 128), &tmX, fb, kt * BK, rank * kRows, bz,
                       (unsigned short)((1u << SW_MC) - 1u));
        }
#else
        tma_load3(sa + A_BYTES, &tmX, fb, kt * BK, 0, bz);      // [BN][64 k]
#endif
      }
    }
  } else {
    // ---------------- consumers: warpgroup c owns weight rows [64c, 64c + 64) ----------------
    const int c = wg - 1, lane = tid & 31;
    int prev = -1;
    for (int kt = kb, it = 0; kt < ke; ++kt, ++it) ring_mma(d, base, full, empty, c, it, prev, lane);
    wgmma_wait<0>();
    fence_regs(d);
    acc_to_red(d, red, c, tid);
  }
  // every block's red[] is complete and visible cluster-wide (without a cluster launch the
  // block is a cluster of one: the barrier and the rank-0 reads stay within it)
  cluster_barrier();

  const Epi e{alpha, beta, act, has_bias, has_beta};
  const int r_lo = q * BM / SW_CL, r_n = (q + 1) * BM / SW_CL - r_lo;
  for (int i = threadIdx.x; i < M * r_n; i += NTHREADS) {
    const int m = i / r_n, r = r_lo + i % r_n;
    const int n = tile * BM + r;
    float v = 0.f;
#pragma unroll
    for (int w = 0; w < SW_CL; ++w)
      v += SW_CL > 1 ? ld_cluster_f32(&red[m * SW_RP + r], (u32)w) : red[m * SW_RP + r];
    if (n < N) {
      u16* p = out + ((size_t)bz * M + m) * N + n;
      const float prev = has_beta ? h2f(*p) : 0.f;
      const float bv = has_bias ? h2f(bias[n]) : 0.f;
      *p = f2h(epi_apply(e, v, prev, bv));
    }
  }
  cluster_barrier();  // no block exits while another still reads its red[]
#endif
}
