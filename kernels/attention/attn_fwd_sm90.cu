// Flash-attention forward, sm_90a: wgmma (tensor cores, async warpgroup MMA) + cp.async.
//
// One thread block computes a (BM = 64*NWG)-row tile of queries for one (batch, q-head):
//   q (B, Hq, Lq, D), k/v (B, Hkv, Lk, D), o (B, Hq, Lq, D), all contiguous, 16-bit.
// Each warpgroup owns 64 query rows. Per KV tile of BN keys:
//   S = Q K^T     wgmma SS (Q and K from shared memory, both K-major, 128B swizzle)
//   online softmax on S in registers (fp32, base-2 exponent, running max m and sum l)
//   O += P V      wgmma RS (P from registers, V from shared memory MN-major, 128B swizzle)
// Schedule: S_{j+1} and P_j V_j are issued back to back and the
// softmax of S_{j+1} runs while P_j V_j is on the tensor cores; K/V tiles stream through an
// NSTAGE-deep ring of shared-memory buffers filled by every thread's cp.async and tracked by
// mbarriers (full: data landed, empty: all warpgroups done with it), so warpgroups are not
// held in lockstep by a block barrier per tile.
//
// Shared-memory tile layout ("SW128 K-major"): a tile of R rows x DP columns is stored as
// DP/64 column blocks of R rows x 128 bytes; inside a block, the 16-byte chunk c of row r
// lives at chunk (c ^ (r % 8)). Blocks start 1024-byte aligned so the XOR matches the
// hardware's address-based swizzle. Head dims below DP are zero-padded in shared memory.
//
// Causal masking is bottom-right aligned: query i (0-based in Lq) sees keys j <= i + kvl - Lq,
// where kvl = clamp(kv_len[b], 0, Lk) (Lk when kv_len is null); keys >= kvl are ignored.
// Rows that see no key produce zeros. With window > 0 (sliding window) query i also ignores
// keys j <= i + kvl - Lq - window: it sees at most `window` keys, itself included; the key
// tiles below every row's window are skipped (the first tile is n_first).
//
// Compile-time parameters (NVRTC -D): ATTN_DP (padded head dim: 64/128/192/256),
// ATTN_BN (keys per tile), ATTN_NWG (warpgroups), ATTN_NSTAGE (K/V buffers), ATTN_BF16,
// ATTN_SCALE_POS (scale > 0).
#include "attn_common.cuh"
#include "attn_wgmma.cuh"
#include "sm90_common.cuh"

#ifndef ATTN_DP
#define ATTN_DP 128
#endif
#ifndef ATTN_BN
#define ATTN_BN 128
#endif
#ifndef ATTN_NWG
#define ATTN_NWG 2
#endif
#ifndef ATTN_SCALE_POS  // 1: scale > 0 (set by the launcher), folds the scale into exp2's FFMA
#define ATTN_SCALE_POS 0
#endif
#ifndef ATTN_NSTAGE
#define ATTN_NSTAGE 2
#endif

#define DP ATTN_DP
#define BN ATTN_BN
#define NWG ATTN_NWG
#define BM (64 * NWG)
#define NT (128 * NWG)

#define CAT4_(a, b, c, d) a##b##c##d
#define CAT4(a, b, c, d) CAT4_(a, b, c, d)
#if ATTN_BF16
#define TYS _bf16
#else
#define TYS _f16
#endif
#define WGMMA_S CAT4(wgmma_ss_m64n, BN, k16, TYS)
#define WGMMA_O CAT4(wgmma_rs_m64n, DP, k16, TYS)

// Shared memory: Q [DP/64][BM][64], K[2] [DP/64][BN][64], V[2] likewise (16-bit elements).
#define Q_BYTES (BM * DP * 2)
#define KV_BYTES (BN * DP * 2)
#define NSTAGE ATTN_NSTAGE
#define PF (NSTAGE - 1)  // prefetch distance in tiles
#if PF < 1
#error "ATTN_NSTAGE must be at least 2"
#endif
#define SMEM_BYTES (Q_BYTES + 2 * NSTAGE * KV_BYTES + 1024)

// Async copy of rows [row0, row0+ROWS) of a (nrows, D) matrix into a SW128 tile; rows past
// nrows are zero-filled; columns D..DP-1 are never written (zeroed once at kernel start).
template <int ROWS>
__device__ __forceinline__ void load_tile(u32 s_base, const elem_t* __restrict__ g, int row0, int nrows,
                                          int D) {
  constexpr int CPR = DP / 8;  // 16-byte chunks per padded row
  const int tid = threadIdx.x;
#pragma unroll
  for (int it = 0; it < (ROWS * CPR + NT - 1) / NT; ++it) {
    const int idx = it * NT + tid;
    if ((ROWS * CPR) % NT == 0 || idx < ROWS * CPR) {
      const int r = idx / CPR, c = idx % CPR;
      if (DP == D || c * 8 < D) {
        const bool ok = row0 + r < nrows;
        const elem_t* src = g + (size_t)(ok ? row0 + r : 0) * D + c * 8;
        const u32 dst = s_base + (c >> 3) * (ROWS * 128) + r * 128 + ((((c & 7) ^ (r & 7))) << 4);
        cp_async16(dst, src, ok);
      }
    }
  }
}

extern "C" __global__ void __launch_bounds__(NT, 1)
attn_fwd_sm90(const elem_t* __restrict__ Q,  // (B, Hq, Lq, D)
              const elem_t* __restrict__ K,  // (B, Hkv, Lk, D)
              const elem_t* __restrict__ V,  // (B, Hkv, Lk, D)
              elem_t* __restrict__ O,        // (B, Hq, Lq, D)
              const int* __restrict__ kv_len,  // (B,) valid keys per batch row, or nullptr
              int Hq, int Hkv, int Lq, int Lk, int D, float scale_log2, int causal, int n_mblk,
              int window) {
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const u32 sbase = (smem_u32(smem_raw) + 1023u) & ~1023u;
  const u32 sQ = sbase;
  const u32 sK0 = sQ + Q_BYTES;
  const u32 sV0 = sK0 + NSTAGE * KV_BYTES;

  const int tid = threadIdx.x;
  const int wg = tid >> 7;
  const int warp = (tid >> 5) & 3;
  const int lane = tid & 31;

  const int bh = blockIdx.x;                    // b * Hq + hq
  const int mblk = n_mblk - 1 - (int)blockIdx.y;  // longest (causal) tiles first
  const int hq = bh % Hq, b = bh / Hq;
  const int hk = hq / (Hq / Hkv);
  const elem_t* q = Q + (size_t)bh * Lq * D;
  const elem_t* k = K + (size_t)(b * Hkv + hk) * Lk * D;
  const elem_t* v = V + (size_t)(b * Hkv + hk) * Lk * D;
  elem_t* o = O + (size_t)bh * Lq * D;
  // Valid keys of this batch row (read on the device: one captured graph serves every length).
  // Below, Lk is only the row stride of k/v; keys at or past kvl are never loaded (zero-filled).
  const int kvl = kv_len == nullptr ? Lk : min(max(__ldg(kv_len + b), 0), Lk);

  const int m0 = mblk * BM;
  const int off = kvl - Lq;  // bottom-right causal alignment
  int n_end = kvl;
  if (causal) n_end = min(kvl, m0 + BM + off);  // keys < m0 + BM + off can be visible
  // Sliding window: the first key tile any row of this block sees (rows m0.. see keys > m0 + off - window).
  const int n_first = window > 0 ? max(0, m0 + off + 1 - window) / BN : 0;
  const int n_base = n_first * BN;  // key index of tile 0
  const int n_tiles = n_end > 0 ? max(0, (n_end + BN - 1) / BN - n_first) : 0;

  if (DP != D) {  // padded head dim: zero the whole buffer once so the pad columns stay 0
    const int n16 = (Q_BYTES + 2 * NSTAGE * KV_BYTES) / 16;
    for (int i = tid; i < n16; i += NT)
      asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};" ::"r"(sbase + i * 16), "r"(0) : "memory");
    __syncthreads();
  }

  float acc[DP / 2];  // O accumulator, m64nDP fragment
#pragma unroll
  for (int i = 0; i < DP / 2; ++i) acc[i] = 0.f;
  float row_m[2] = {ATTN_NEG_INF, ATTN_NEG_INF};  // running max (base-2 logits)
  float row_l[2] = {0.f, 0.f};                    // running sum (this thread's columns)

  // This thread's rows (absolute query index) for h = 0, 1.
  const int r_base = m0 + wg * 64 + warp * 16 + (lane >> 2);
  const int c_base = 2 * (lane & 3);

  float s[BN / 2];  // S tile, m64nBN fragment
  u32 p[BN / 4];    // P tile as wgmma A fragments (16-bit pairs)

  // S = Q K^T for the K tile at sK (async; caller commits and waits).
  auto issue_s = [&](u32 sK) {
#pragma unroll
    for (int kk = 0; kk < DP / 16; ++kk) {
      const u64 da = make_desc(sQ + (kk >> 2) * (BM * 128) + wg * (64 * 128) + (kk & 3) * 32, 16, 1024);
      const u64 db = make_desc(sK + (kk >> 2) * (BN * 128) + (kk & 3) * 32, 16, 1024);
      WGMMA_S(s, da, db, kk > 0 ? 1 : 0);
    }
  };
  // O += P V for the V tile at sV (async).
  auto issue_o = [&](u32 sV) {
#pragma unroll
    for (int t = 0; t < BN / 16; ++t) {
      // keys 16t..16t+15: two 8-row groups of every 64-column block (LBO = block stride)
      const u64 db = make_desc(sV + t * (16 * 128), BN * 128, 1024);
      WGMMA_O(acc, p[4 * t], p[4 * t + 1], p[4 * t + 2], p[4 * t + 3], db, 1);
    }
  };
  // Scale, mask and exponentiate s in place for the key tile starting at n0; update row_m,
  // row_l; return the rescale factors for the accumulator in alpha.
  auto softmax = [&](int n0, float (&alpha)[2]) {
#if !ATTN_SCALE_POS  // any sign of scale: scale first, then mask and take the max
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) s[i] *= scale_log2;
#endif
    const bool need_mask = (n0 + BN > kvl) || (causal && n0 + BN - 1 > m0 + off) ||
                           (window > 0 && n0 <= m0 + BM - 1 + off - window);
    if (need_mask) {
#pragma unroll
      for (int t = 0; t < BN / 8; ++t)
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int col = n0 + 8 * t + c_base + e;
            const int row = r_base + 8 * h;
            if (col >= kvl || (causal && col > row + off) || (window > 0 && col <= row + off - window))
              s[4 * t + 2 * h + e] = ATTN_NEG_INF;
          }
    }
#if ATTN_SCALE_POS  // scale > 0: max of raw logits, scale folded into the exponent's FFMA
    const float sc = scale_log2;
#else
    const float sc = 1.f;
#endif
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float mx = ATTN_NEG_INF;
#pragma unroll
      for (int t = 0; t < BN / 8; ++t) mx = fmaxf(mx, fmaxf(s[4 * t + 2 * h], s[4 * t + 2 * h + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      mx = fmaxf(row_m[h], mx * sc);  // running max in the scaled (base-2) domain
      const float m_use = mx == ATTN_NEG_INF ? 0.f : mx;
      alpha[h] = fast_exp2(row_m[h] - m_use);
      row_m[h] = mx;
      float sum = 0.f;
#pragma unroll
      for (int t = 0; t < BN / 8; ++t) {
        const float x0 = fmaf(s[4 * t + 2 * h], sc, -m_use);
        const float x1 = fmaf(s[4 * t + 2 * h + 1], sc, -m_use);
        s[4 * t + 2 * h] = fast_exp2(x0);
        s[4 * t + 2 * h + 1] = fast_exp2(x1);
        sum += s[4 * t + 2 * h] + s[4 * t + 2 * h + 1];
      }
      row_l[h] = row_l[h] * alpha[h] + sum;
    }
  };
  auto rescale = [&](const float (&alpha)[2]) {
#pragma unroll
    for (int t = 0; t < DP / 8; ++t) {
      acc[4 * t + 0] *= alpha[0];
      acc[4 * t + 1] *= alpha[0];
      acc[4 * t + 2] *= alpha[1];
      acc[4 * t + 3] *= alpha[1];
    }
  };
  auto to_p = [&]() {
#pragma unroll
    for (int t = 0; t < BN / 8; ++t) {
      p[2 * t] = pack2(s[4 * t], s[4 * t + 1]);
      p[2 * t + 1] = pack2(s[4 * t + 2], s[4 * t + 3]);
    }
  };

  // v3: as v2, but the copy pipeline runs on mbarriers instead of a block-wide barrier per
  // tile, so warpgroups drift apart (one's softmax overlaps another's matmuls).
  // Copy group g = {K_{g+1}, V_g} (each thread's cp.async copies, then an arrive on
  // full[g % NSTAGE]); after tile j's matmuls each thread arrives on empty[j % NSTAGE].
  // Group g (g >= NSTAGE) reuses the buffers of group g - NSTAGE.
  __shared__ __align__(8) u64 bars[2 * NSTAGE];
  const u32 full0 = smem_u32(&bars[0]), empty0 = smem_u32(&bars[NSTAGE]);
  if (tid == 0) {
#pragma unroll
    for (int i = 0; i < 2 * NSTAGE; ++i) mbar_init(full0 + 8 * i, NT);
  }
  __syncthreads();
  auto issue_group = [&](int g) {  // only for g < n_tiles
    if (g >= NSTAGE) mbar_wait(empty0 + 8 * (g % NSTAGE), ((g / NSTAGE) + 1) & 1);
    if (g + 1 < n_tiles) load_tile<BN>(sK0 + ((g + 1) % NSTAGE) * KV_BYTES, k, n_base + (g + 1) * BN, kvl, D);
    load_tile<BN>(sV0 + (g % NSTAGE) * KV_BYTES, v, n_base + g * BN, kvl, D);
    cp_async_commit();
    mbar_arrive_cp_async(full0 + 8 * (g % NSTAGE));
  };
  load_tile<BM>(sQ, q, m0, Lq, D);
  if (n_tiles > 0) load_tile<BN>(sK0, k, n_base, kvl, D);
  cp_async_commit();
#pragma unroll
  for (int g = 0; g < PF; ++g) {
    if (g < n_tiles) issue_group(g);
    else cp_async_commit();  // keep the group count uniform for the wait below
  }
  if (n_tiles > 0) {
    cp_async_wait<PF>();  // Q and K_0
    fence_proxy_async();
    __syncthreads();
    wgmma_fence();
    issue_s(sK0);
    wgmma_commit();
    wgmma_wait<0>();
    fence_regs(s);
    float alpha[2];
    softmax(n_base, alpha);
    to_p();
    __syncthreads();  // K buffer 0 is free for group NSTAGE-1
  }
  for (int j = 0; j + 1 < n_tiles; ++j) {
    mbar_wait(full0 + 8 * (j % NSTAGE), (j / NSTAGE) & 1);
    fence_proxy_async();
    wgmma_fence();
    issue_s(sK0 + ((j + 1) % NSTAGE) * KV_BYTES);
    wgmma_commit();
    issue_o(sV0 + (j % NSTAGE) * KV_BYTES);
    wgmma_commit();
    if (j + PF < n_tiles) issue_group(j + PF);
    wgmma_wait<1>();
    fence_regs(s);
    float alpha[2];
    softmax(n_base + (j + 1) * BN, alpha);
    wgmma_wait<0>();
    fence_regs(acc);
    fence_regs(p);
    mbar_arrive(empty0 + 8 * (j % NSTAGE));
    rescale(alpha);
    to_p();
  }
  if (n_tiles > 0) {
    const int j = n_tiles - 1;
    mbar_wait(full0 + 8 * (j % NSTAGE), (j / NSTAGE) & 1);
    fence_proxy_async();
    wgmma_fence();
    issue_o(sV0 + (j % NSTAGE) * KV_BYTES);
    wgmma_commit();
    wgmma_wait<0>();
    fence_regs(acc);
    fence_regs(p);
  }
  cp_async_wait<0>();

  // ---- epilogue: O / l ----
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float l = row_l[h];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    const float inv = l > 0.f ? 1.f / l : 0.f;
    const int row = r_base + 8 * h;
    if (row < Lq) {
      elem_t* orow = o + (size_t)row * D;
#pragma unroll
      for (int t = 0; t < DP / 8; ++t) {
        const int col = 8 * t + c_base;
        if (DP == D || col < D)
          *reinterpret_cast<u32*>(orow + col) = pack2(acc[4 * t + 2 * h] * inv, acc[4 * t + 2 * h + 1] * inv);
      }
    }
  }
}
