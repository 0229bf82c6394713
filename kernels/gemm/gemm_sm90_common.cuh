// Used by the sm_90a GEMM (gemm_sm90.cu): tile constants, the TMA load and the tile-order
// decode (descriptors, mbarriers and wgmma fences: sm90_common.cuh). The including
// file defines BM (rows of one tile), BN, NCW/STAGES/GROUP_M as it needs, before use.
#include "sm90_common.cuh"
#ifndef GEMM_EPI_PLAIN
#define GEMM_EPI_PLAIN 0
#endif
#define BK 64
#ifndef GEMM_TRANS_B
#define GEMM_TRANS_B 0
#endif
// Blocks of a cluster that share each stage of the ring (gemm_skinny_tma.cu with SW_MC > 1: the
// activation tile is multicast to them, so a stage is free only when every one is done with it).
#ifndef RING_PEERS
#define RING_PEERS 1
#endif
// B descriptor of k16 step kk: MN-major [BN/64][64 k][64 n], or (GEMM_TRANS_B, b given
// (N, K)) K-major [BN][64 k] with one 128-byte swizzled row per n, exactly like A.
#if GEMM_TRANS_B
#define B_DESC(sb, kk) make_desc((sb) + (kk) * 32, 16, 1024)
#else
#define B_DESC(sb, kk) make_desc((sb) + (kk) * (16 * 128), BK * 128, 1024)
#endif
#define A_BYTES (BM * BK * 2)
#define B_BYTES (BK * BN * 2)
#define STAGE_BYTES (A_BYTES + B_BYTES)
#define NTHREADS (128 * (NCW + 1))
#define NACC (BN / 2)

#define CAT3_(a, b, c) a##b##c
#define CAT3(a, b, c) CAT3_(a, b, c)
#if GEMM_BF16
#define WGMMA CAT3(wgmma_m64n, BN, k16_bf16)
#else
#define WGMMA CAT3(wgmma_m64n, BN, k16_f16)
#endif

struct __align__(64) TmaDesc {
  u64 v[16];
};

__device__ __forceinline__ void tma_load3(u32 dst, const TmaDesc* tm, u32 bar, int c0, int c1, int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5}], [%2];" ::"r"(dst),
      "l"(tm), "r"(bar), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}

// As tma_load3, and the same bytes land at the same offset (and complete the transaction on
// the barrier at the same offset) in every block of the cluster named in `mask`.
__device__ __forceinline__ void tma_load3_mc(u32 dst, const TmaDesc* tm, u32 bar, int c0, int c1, int c2,
                                             unsigned short mask) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
      " [%0], [%1, {%3, %4, %5}], [%2], %6;" ::"r"(dst),
      "l"(tm), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "h"(mask)
      : "memory");
}

// One warp's arrival on the barrier at shared address `bar` of every block of the cluster:
// lane r arrives on block r's (RING_PEERS blocks, in parallel; default .release.cta semantics,
// as the stage's readers are this warp's completed wgmma); one block: lane 0, locally.
__device__ __forceinline__ void ring_release(u32 bar, int lane) {
#if RING_PEERS > 1
  if (lane < RING_PEERS) {
    u32 ra;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(ra) : "r"(bar), "r"(lane));
    asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];" ::"r"(ra) : "memory");
  }
#else
  if (lane == 0) mbar_arrive(bar);
#endif
}

// Linear tile index -> (batch, split, m-tile, n-tile); GROUP_M m-tiles share each n sweep.
__device__ __forceinline__ void decode_tile(int t, int tiles_m, int tiles_n, int splits, int& bz, int& sp, int& tm,
                                            int& tn) {
  const int per = tiles_m * tiles_n;
  const int local = t % per;
  const int rest = t / per;
  sp = rest % splits;
  bz = rest / splits;
  const int group = local / (GROUP_M * tiles_n);
  const int first_m = group * GROUP_M;
  const int gsz = min(tiles_m - first_m, GROUP_M);
  const int in = local % (GROUP_M * tiles_n);
  tm = first_m + in % gsz;
  tn = in / gsz;
}

// ---- the TMA ring shared by gemm_sm90.cu and gemm_skinny_tma.cu ----
// STAGES stages of STAGE_BYTES (A tile, then B tile) at `base`; full[s] (one arrival plus the
// TMA transaction bytes) says stage s landed, empty[s] (one arrival per consumer warp) says it
// may be overwritten. Iteration `it` of a thread's sequence uses stage it % STAGES with phase
// (it / STAGES) & 1.

// Thread 0: the barriers, and the tensor maps prefetched (a __syncthreads must follow; a
// cluster barrier with RING_PEERS > 1).
__device__ __forceinline__ void ring_init(u32 full, u32 empty, const void* tm_a, const void* tm_b) {
#pragma unroll
  for (int s = 0; s < STAGES; ++s) {
    mbar_init(full + 8 * s, 1);
    mbar_init(empty + 8 * s, 4 * NCW * RING_PEERS);
  }
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  asm volatile("prefetch.tensormap [%0];" ::"l"(tm_a) : "memory");
  asm volatile("prefetch.tensormap [%0];" ::"l"(tm_b) : "memory");
}

// Every thread at kernel start: thread 0 sets up the ring, then the barriers exist for the
// whole block (and, RING_PEERS > 1, for every peer block before any multicast into it or
// remote arrival on it); then wait for the inputs' producer (programmatic dependent launch)
// and let the next kernel begin launching.
__device__ __forceinline__ void ring_start(u32 full, u32 empty, const void* tm_a, const void* tm_b) {
  if (threadIdx.x == 0) ring_init(full, empty, tm_a, tm_b);
#if RING_PEERS > 1
  cluster_barrier();
#else
  __syncthreads();
#endif
  pdl_wait();
  pdl_launch_dependents();
}

// Producer: wait until iteration `it`'s stage is free, expect its bytes; returns the stage's
// shared address (A tile; the B tile follows at + A_BYTES).
__device__ __forceinline__ u32 ring_acquire(u32 base, u32 full, u32 empty, int it) {
  const int st = it % STAGES;
  mbar_wait(empty + 8 * st, ((u32)(it / STAGES) & 1u) ^ 1u);
  mbar_arrive_tx(full + 8 * st, STAGE_BYTES);
  return base + st * STAGE_BYTES;
}

// Consumer warpgroup c, iteration `it`: wait for the stage, d += A[64c .. 64c + 64) x B over
// its 64 k, and release the previous iteration's stage once this one's wgmma are issued
// (one arrival per warp, on every block sharing the ring). `prev`: the stage to release next
// (-1: none).
__device__ __forceinline__ void ring_mma(float (&d)[NACC], u32 base, u32 full, u32 empty, int c, int it, int& prev,
                                         int lane) {
  const int st = it % STAGES;
  mbar_wait(full + 8 * st, (u32)(it / STAGES) & 1u);
  const u32 sa = base + st * STAGE_BYTES + c * (64 * 128);
  const u32 sb = base + st * STAGE_BYTES + A_BYTES;
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < BK / 16; ++kk) WGMMA(d, make_desc(sa + kk * 32, 16, 1024), B_DESC(sb, kk));
  wgmma_commit();
  wgmma_wait<1>();
  if (prev >= 0) {
    __syncwarp();
    ring_release(empty + 8 * prev, lane);
  }
  prev = st;
}
