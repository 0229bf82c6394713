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
