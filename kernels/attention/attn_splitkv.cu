// Split-KV flash attention on CUDA cores ("flash-decoding"): the fast path for few query rows
// (decode, Lq = 1..8) and the portable path for everything else the sm_90 kernel does not
// take (float32, paged KV, GPUs other than sm_90).
//
// Grid: x = ((i * Hkv + hk) * n_hchunk + hc)  (query position i, kv head hk, head chunk hc),
//       y = split (at most n_split), z = batch.
// A block serves GT query heads that share kv head hk (GQA: heads hk*g .. hk*g+g-1), so each
// K/V row is read from memory once for all of them. NWARP warps (4, 8 or 16: more warps per
// block serve a short cache with fewer splits); a warp covers KPW keys per step,
// LPK lanes per key, each lane 8 head-dim elements (one 16-byte load of K and of V; two for
// float32). Each lane group keeps its own running max / sum / accumulator (fp32); they are
// merged across the warp with shuffles and across warps in shared memory.
//
// Valid keys: kvl = clamp(kv_len[b], 0, Lk) (kv_len == nullptr: kvl = Lk); query i sees keys
// j < kvl, and with causal j <= kvl - Lq + i; with window > 0 (sliding window) also
// j > kvl - Lq + i - window: a split's key range starts at that bound at the earliest, so the
// keys before the window are never loaded (splits wholly before it do nothing). The split of the keys is computed here from kvl
// (split_geometry, shared with the combine kernel): n_act <= n_split splits of `chunk` keys;
// blocks of splits >= n_act exit at once, so a long cache with few valid keys costs what a
// short one costs. Key loops are bounded by kvl read on the device (graph-capturable).
//   n_act == 1: the block writes the normalised output o (B, Hq, Lq, D).
//   n_act  > 1: it writes partials ws_o (B, Hq, Lq, n_split, D) and ws_ml (..., 2) = (m, l),
//               base-2 max and sum; attn_splitkv_combine merges the n_act valid ones.
//
// Cluster merge (ATTN_CL = 2, 4 or 8; sm_90): grid y = ATTN_CL splits form one thread-block
// cluster; each block keeps its partial (m, l, o) in shared memory and, after a cluster
// barrier, rank q merges every ATTN_CL-th (head, dim) output of the row group over the ranks
// in rank order (distributed shared memory; deterministic) and writes o. No workspace, no
// combine kernel. Splits past n_act take part with an empty key range (no early exit: every
// block of a cluster must reach its barriers).
//
// Paged KV (ATTN_PAGED=1): K/V are a block pool (num_blocks, Hkv, block_size, D) and key j of
// row b lives in physical block clamp(block_table[b, j / block_size], 0, num_blocks - 1).
//
// Compile-time parameters: ATTN_D (head dim, multiple of 8, <= 256), ATTN_GT (heads per
// block, 1 to 8), ATTN_NWARP (warps per block), ATTN_BF16, ATTN_F32, ATTN_PAGED, ATTN_CL,
// ATTN_GRANULE, ATTN_MINB (launch bounds: resident blocks per SM, which caps registers),
// ATTN_BULK (stages of the bulk-copy K/V ring; 16-bit, contiguous K/V, sm_90; see below).
//
// Bulk ring (ATTN_BULK = NST > 0). The keys of a (b, hk) row are contiguous, so the WK =
// KPW * UK rows a warp takes in one step are two `cp.async.bulk` copies (K and V) into
// shared memory. Each warp has its own ring of NST stages and its own `full` mbarriers: its
// lane 0 issues the copies of the next NST steps and completes a stage's barrier with the
// byte count; the warp waits on the barrier, reads its rows from the stage into registers
// (lane group lg, key u: row u * KPW + lg, so one load of the warp reads KPW whole rows),
// does the step's math, and lane 0 refills the stage NST steps ahead. No block-wide wait:
// many bytes stay in flight without the registers the direct loads would need. Faster on
// H200 (4.8 TB/s) at long caches, not on H100 (benchmarks/RESULTS.md); the planner turns it on by the GPU's bandwidth per SM (attention/_plan.py).
// Dynamic shared memory: 1024 bytes of barriers, then the stages (warp w's stage s of K at
// rows (w * NST + s) * WK of the K ring, V likewise); after the key loop the per-warp
// partials sm_o overlay the stages.
#include "attn_common.cuh"
#if ATTN_BULK
#include "sm90_common.cuh"
#endif

#ifndef ATTN_D
#define ATTN_D 128
#endif
#ifndef ATTN_GT
#define ATTN_GT 4
#endif
#ifndef ATTN_PAGED
#define ATTN_PAGED 0
#endif
#ifndef ATTN_BULK  // stages of the bulk-copy K/V ring (0: K/V loaded straight to registers)
#define ATTN_BULK 0
#endif
#if ATTN_BULK && (ATTN_PAGED || ATTN_F32)
#error "ATTN_BULK needs contiguous 16-bit K/V"
#endif
#ifndef ATTN_MINB  // minimum resident blocks per SM (__launch_bounds__), caps registers
#define ATTN_MINB 1
#endif
#ifndef ATTN_CL  // splits merged inside one thread-block cluster (1: workspace + combine)
#define ATTN_CL 1
#endif
#if ATTN_CL > 1
#define ATTN_CLUSTER_ATTR __cluster_dims__(1, ATTN_CL, 1)
#else
#define ATTN_CLUSTER_ATTR
#endif
#ifndef ATTN_GRANULE  // keys per split are a multiple of this (attention/_plan.py SPLIT_GRANULE)
#define ATTN_GRANULE 64
#endif

#define DH ATTN_D
#define GT ATTN_GT
#define NCH (DH / 8)                                                       // 8-element chunks per row
#define LPK (NCH <= 1 ? 1 : NCH <= 2 ? 2 : NCH <= 4 ? 4 : NCH <= 8 ? 8 : NCH <= 16 ? 16 : 32)  // lanes per key
#define KPW (32 / LPK)                                                     // keys per warp step
#define UK 4  // keys per lane group per step
#ifndef ATTN_NWARP
#define ATTN_NWARP 4
#endif
#define NWARP ATTN_NWARP
#if ATTN_BULK * ATTN_NWARP * 8 > 1024
#error "ATTN_BULK: the ring's mbarriers (8 bytes a warp and stage) exceed their 1024 bytes"
#endif

#include "attn_splitkv_parts.cuh"

// One step's math for a lane group: keys J0 + u * JS (u < UK) with rows kc / vc (zero past
// ke), folded into the running max m, sum l and accumulator acc of every head. A macro, not
// a lambda, so the register path compiles exactly as it did before the bulk ring.
#define SPLITKV_STEP_MATH(J0, JS)                                                                    \
  do {                                                                                               \
    float sc[GT][UK];                                                                                \
    _Pragma("unroll")                                                                                \
    for (int u = 0; u < UK; ++u) {                                                                   \
      float kf[8];                                                                                   \
      cvt8(kc[u], kf);                                                                               \
      _Pragma("unroll")                                                                              \
      for (int t = 0; t < GT; ++t) {                                                                 \
        float d = 0.f;                                                                               \
        _Pragma("unroll")                                                                            \
        for (int e = 0; e < 8; ++e) d = fmaf(qf[t][e], kf[e], d);                                    \
        sc[t][u] = d;                                                                                \
      }                                                                                              \
    }                                                                                                \
    _Pragma("unroll")                                                                                \
    for (int t = 0; t < GT; ++t)                                                                     \
      _Pragma("unroll")                                                                              \
      for (int u = 0; u < UK; ++u) {                                                                 \
        _Pragma("unroll")                                                                            \
        for (int o = LPK / 2; o > 0; o >>= 1) sc[t][u] += __shfl_xor_sync(0xffffffffu, sc[t][u], o); \
        if ((J0) + u * (JS) >= ke) sc[t][u] = ATTN_NEG_INF;                                          \
      }                                                                                              \
    float vf[UK][8];                                                                                 \
    _Pragma("unroll")                                                                                \
    for (int u = 0; u < UK; ++u) cvt8(vc[u], vf[u]);                                                 \
    _Pragma("unroll")                                                                                \
    for (int t = 0; t < GT; ++t) {                                                                   \
      float mx = m[t];                                                                               \
      _Pragma("unroll")                                                                              \
      for (int u = 0; u < UK; ++u) mx = fmaxf(mx, sc[t][u]);                                         \
      const float mu = mx == ATTN_NEG_INF ? 0.f : mx;  /* no valid key yet: all 0 */                 \
      const float alpha = fast_exp2(m[t] - mu);                                                      \
      m[t] = mx;                                                                                     \
      l[t] *= alpha;                                                                                 \
      _Pragma("unroll")                                                                              \
      for (int e = 0; e < 8; ++e) acc[t][e] *= alpha;                                                \
      _Pragma("unroll")                                                                              \
      for (int u = 0; u < UK; ++u) {                                                                 \
        const float pu = fast_exp2(sc[t][u] - mu);                                                   \
        l[t] += pu;                                                                                  \
        _Pragma("unroll")                                                                            \
        for (int e = 0; e < 8; ++e) acc[t][e] = fmaf(pu, vf[u][e], acc[t][e]);                       \
      }                                                                                              \
    }                                                                                                \
  } while (0)

extern "C" __global__ void __launch_bounds__(NWARP * 32, ATTN_MINB) ATTN_CLUSTER_ATTR
attn_splitkv(const elem_t* __restrict__ Q,  // (B, Hq, Lq, D)
             const elem_t* __restrict__ K,  // (B, Hkv, Lk, D) or pool (NB, Hkv, BS, D)
             const elem_t* __restrict__ V,  // same as K
             elem_t* __restrict__ O,        // (B, Hq, Lq, D)
             float* __restrict__ ws_o,      // (B, Hq, Lq, n_split, D)
             float* __restrict__ ws_ml,     // (B, Hq, Lq, n_split, 2)
             const int* __restrict__ kv_len,       // (B,) or nullptr
             const int* __restrict__ block_table,  // (B, max_blocks) (ATTN_PAGED)
             int Hq, int Hkv, int Lq, int Lk, float scale_log2, int causal, int n_split,
             int n_hchunk, int max_blocks, int block_size, int num_blocks, int window) {
  __shared__ float sm_m[NWARP][GT], sm_l[NWARP][GT];
#if ATTN_BULK  // the per-warp partials reuse the ring once every warp has left the key loop
  extern __shared__ __align__(128) unsigned char dsm[];
  float(&sm_o)[NWARP][GT][DH] = *reinterpret_cast<float(*)[NWARP][GT][DH]>(dsm + 1024);
#else
  __shared__ float sm_o[NWARP][GT][DH];
#endif
#if ATTN_CL > 1
  __shared__ float cl_m[GT], cl_l[GT];  // this block's partial max and sum per head
#endif

  // Programmatic dependent launch (sm_90+): wait for the previous kernel's results before
  // reading anything, and let the combine kernel launch while this grid runs.
  pdl_wait();
  pdl_launch_dependents();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int lg = lane / LPK, sl = lane % LPK;
  const bool lane_ok = sl < NCH;
  const int g = Hq / Hkv;
  int x = blockIdx.x;
  const int hc = x % n_hchunk;
  x /= n_hchunk;
  const int hk = x % Hkv;
  const int i = x / Hkv;
  const int split = blockIdx.y, b = blockIdx.z;
  const int h0 = hk * g + hc * GT;                // first q head of this block
  const int ng = min(GT, g - hc * GT);            // heads served

  const int kvl = valid_keys(kv_len, b, Lk);
  int chunk, n_act;
  split_geometry(kvl, n_split, chunk, n_act);
#if ATTN_CL == 1
  if (split >= n_act) return;  // block-uniform, before any barrier
#endif
  const int off = kvl - Lq;
  const int kend = causal ? min(kvl, i + off + 1) : kvl;
  const int kbeg = window > 0 ? max(0, i + off + 1 - window) : 0;  // first key in the window
  const int ks = max(split * chunk, kbeg);  // this split's keys: [split * chunk, + chunk) in the window
  const int ke = min(kend, split * chunk + chunk);

  // q for my chunk of the head dim (raw; converted once the first K/V loads are in flight).
  Row8 qr[GT];
#pragma unroll
  for (int t = 0; t < GT; ++t) {
    const int hq = h0 + (t < ng ? t : 0);
    zero8(qr[t]);
    if (lane_ok) ld8(Q + (((size_t)b * Hq + hq) * Lq + i) * DH + sl * 8, qr[t]);
  }

  float m[GT], l[GT], acc[GT][8];
#pragma unroll
  for (int t = 0; t < GT; ++t) {
    m[t] = ATTN_NEG_INF;
    l[t] = 0.f;
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[t][e] = 0.f;
  }

#if ATTN_PAGED
  const int* bt = block_table + (size_t)b * max_blocks;
  const size_t head_off = (size_t)hk * block_size;  // row of (phys, hk, 0) = phys*Hkv*BS + hk*BS
  const size_t blk_rows = (size_t)Hkv * block_size;
#else
  const size_t kv_row0 = ((size_t)b * Hkv + hk) * Lk;
#endif
  constexpr int STEP = NWARP * KPW * UK;
#if ATTN_BULK
  // The ring (see the header): warp w's full[s] at bars + 8 (w NST + s).
  constexpr int NST = ATTN_BULK;
  constexpr u32 ROWB = DH * sizeof(elem_t);
  constexpr int WK = KPW * UK;  // rows of one warp step
  const u32 bars = smem_u32(dsm);
  const elem_t* ring_k = reinterpret_cast<const elem_t*>(dsm + 1024);  // (NWARP, NST, WK, DH)
  const elem_t* ring_v = ring_k + (size_t)NST * STEP * DH;              // (NWARP, NST, WK, DH)
  auto issue = [&](int it, int st) {  // lane 0: this warp's keys of step `it` into stage `st`
    const int j = ks + it * STEP + warp * WK;
    if (j >= ke) return;
    const u32 bytes = (u32)min(WK, ke - j) * ROWB;
    const u32 full = bars + 8 * (warp * NST + st);
    const size_t o = (size_t)(warp * NST + st) * WK * DH;
    mbar_arrive_tx(full, 2 * bytes);
    bulk_g2s(smem_u32(ring_k + o), K + (kv_row0 + j) * DH, bytes, full);
    bulk_g2s(smem_u32(ring_v + o), V + (kv_row0 + j) * DH, bytes, full);
  };
  if (lane == 0) {
#pragma unroll 1
    for (int s2 = 0; s2 < NST; ++s2) mbar_init(bars + 8 * (warp * NST + s2), 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#pragma unroll 1
    for (int s2 = 0; s2 < NST; ++s2) issue(s2, s2);
  }
#else
  // Row of key j of this (b, hk) in K/V: through the block table when paged (an entry
  // outside the pool is clamped into it), else contiguous from kv_row0.
  auto kv_row = [&](int j) -> size_t {
#if ATTN_PAGED
    const int lb = j / block_size;
    const int phys = min(max(__ldg(bt + lb), 0), num_blocks - 1);
    return (size_t)phys * blk_rows + head_off + (j - lb * block_size);
#else
    return kv_row0 + j;
#endif
  };
  // K/V rows of keys base .. base+UK-1 of this lane group (zeros past ke).
  auto load_step = [&](int base, Row8 (&kr)[UK], Row8 (&vr)[UK]) {
#pragma unroll
    for (int u = 0; u < UK; ++u) {
      zero8(kr[u]);
      zero8(vr[u]);
      const int j = base + u;
      if (lane_ok && j < ke) {
        const size_t row = kv_row(j);
        ld8(K + row * DH + sl * 8, kr[u]);
        ld8(V + row * DH + sl * 8, vr[u]);
      }
    }
  };
  // The first step's K/V rows are requested (into L2) before q is converted, so the two
  // memory round trips overlap instead of following each other.
  auto prefetch_step = [&](int base) {
#pragma unroll
    for (int u = 0; u < UK; ++u) {
      const int j = base + u;
      if (lane_ok && j < ke) {
        const size_t row = kv_row(j);
        asm volatile("prefetch.global.L2 [%0];" ::"l"(K + row * DH + sl * 8));
        asm volatile("prefetch.global.L2 [%0];" ::"l"(V + row * DH + sl * 8));
      }
    }
  };
  prefetch_step(ks + warp * KPW * UK + lg * UK);
#endif
  float qf[GT][8];  // q pre-scaled to base 2
#pragma unroll
  for (int t = 0; t < GT; ++t) {
    cvt8(qr[t], qf[t]);
#pragma unroll
    for (int e = 0; e < 8; ++e) qf[t][e] *= scale_log2;
  }
#if ATTN_BULK
#pragma unroll 1
  for (int it = 0; ks + it * STEP + warp * WK < ke; ++it) {  // warp-uniform bound
    const int st = it % NST;
    mbar_wait(bars + 8 * (warp * NST + st), (u32)(it / NST) & 1u);
    const int j0 = ks + it * STEP + warp * WK + lg;  // key of u = 0; u adds KPW keys
    Row8 kc[UK], vc[UK];
#pragma unroll
    for (int u = 0; u < UK; ++u) {
      zero8(kc[u]);
      zero8(vc[u]);
      if (lane_ok && j0 + u * KPW < ke) {
        const size_t o = ((size_t)(warp * NST + st) * WK + lg + u * KPW) * DH + sl * 8;
        kc[u].a = *reinterpret_cast<const uint4*>(ring_k + o);
        vc[u].a = *reinterpret_cast<const uint4*>(ring_v + o);
      }
    }
    SPLITKV_STEP_MATH(j0, KPW);
    __syncwarp();  // every lane has used its rows of the stage
    if (lane == 0) {
      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // reads before the refill
      issue(it + NST, st);
    }
  }
#else
  // The loop bound is warp-uniform (shuffles below need the whole warp); keys past ke are masked.
  for (int wbase = ks + warp * KPW * UK; wbase < ke; wbase += STEP) {
    const int base = wbase + lg * UK;
    Row8 kc[UK], vc[UK];
    load_step(base, kc, vc);
    SPLITKV_STEP_MATH(base, 1);
  }
#endif
  // Merge lane groups of the warp (lanes with equal sl).
#pragma unroll
  for (int o = LPK; o < 32; o <<= 1) {
#pragma unroll
    for (int t = 0; t < GT; ++t) {
      const float mo = __shfl_xor_sync(0xffffffffu, m[t], o);
      const float lo = __shfl_xor_sync(0xffffffffu, l[t], o);
      const float mx = fmaxf(m[t], mo);
      const float mu = mx == ATTN_NEG_INF ? 0.f : mx;
      const float a = fast_exp2(m[t] - mu), ao = fast_exp2(mo - mu);
      l[t] = l[t] * a + lo * ao;
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const float xo = __shfl_xor_sync(0xffffffffu, acc[t][e], o);
        acc[t][e] = acc[t][e] * a + xo * ao;
      }
      m[t] = mx;
    }
  }
#if ATTN_BULK
  __syncthreads();  // no warp still reads the ring that sm_o overlays
#endif
  if (lg == 0) {
#pragma unroll
    for (int t = 0; t < GT; ++t) {
      if (sl == 0) {
        sm_m[warp][t] = m[t];
        sm_l[warp][t] = l[t];
      }
      if (lane_ok) {
#pragma unroll
        for (int e = 0; e < 8; ++e) sm_o[warp][t][sl * 8 + e] = acc[t][e];
      }
    }
  }
  __syncthreads();

  // Merge warps: thread -> (head t, dim d) pairs.
  for (int idx = threadIdx.x; idx < ng * DH; idx += NWARP * 32) {
    const int t = idx / DH, d = idx % DH;
    float mx = ATTN_NEG_INF;
#pragma unroll
    for (int w = 0; w < NWARP; ++w) mx = fmaxf(mx, sm_m[w][t]);
    const float mu = mx == ATTN_NEG_INF ? 0.f : mx;
    float lt = 0.f, ot = 0.f;
#pragma unroll
    for (int w = 0; w < NWARP; ++w) {
      const float a = fast_exp2(sm_m[w][t] - mu);
      lt += sm_l[w][t] * a;
      ot += sm_o[w][t][d] * a;
    }
#if ATTN_CL > 1
    sm_o[0][t][d] = ot;  // this block's partial: (t, d) is read and written by this thread only
    if (d == 0) {
      cl_m[t] = mx;
      cl_l[t] = lt;
    }
#else
    const size_t row = ((size_t)b * Hq + h0 + t) * Lq + i;
    if (n_act == 1) {
      store1(O + row * DH + d, lt > 0.f ? ot / lt : 0.f);
    } else {
      const size_t prow = row * n_split + split;
      ws_o[prow * DH + d] = ot;
      if (d == 0) {
        ws_ml[prow * 2] = mx;
        ws_ml[prow * 2 + 1] = lt;
      }
    }
#endif
  }
#if ATTN_CL > 1
  cluster_merge(O, sm_o, cl_m, cl_l, ng, ((size_t)b * Hq + h0) * Lq + i, Lq);
#endif
}

#define CNT 64  // combine threads; n_split <= CNT (_attention.MAX_SPLITS)

// Merge the n_act partials of each output row (nothing to do when n_act == 1: the split
// kernel wrote the row). Grid x = B * Hq * Lq rows; CNT threads; rows_per_b = Hq * Lq.
extern "C" __global__ void __launch_bounds__(CNT)
attn_splitkv_combine(const float* __restrict__ ws_o, const float* __restrict__ ws_ml,
                     elem_t* __restrict__ O, const int* __restrict__ kv_len, int n_split, int Lk,
                     int rows_per_b) {
  __shared__ float sm_w[CNT];
  __shared__ float sm_red[CNT / 32];
  pdl_wait();  // the split kernel's partials (launched early with PDL)
  const size_t row = blockIdx.x;
  const int b = (int)(row / rows_per_b);
  int chunk, n_act;
  split_geometry(valid_keys(kv_len, b, Lk), n_split, chunk, n_act);
  if (n_act <= 1) return;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const float* ml = ws_ml + row * n_split * 2;
  const float ms = tid < n_act ? ml[2 * tid] : ATTN_NEG_INF;
  const float ls = tid < n_act ? ml[2 * tid + 1] : 0.f;
  float mx = ms;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
  if (lane == 0) sm_red[warp] = mx;
  __syncthreads();
  mx = sm_red[0];
#pragma unroll
  for (int w = 1; w < CNT / 32; ++w) mx = fmaxf(mx, sm_red[w]);
  const float mu = mx == ATTN_NEG_INF ? 0.f : mx;
  const float a = tid < n_act ? fast_exp2(ms - mu) : 0.f;
  float lt = ls * a;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) lt += __shfl_xor_sync(0xffffffffu, lt, o);
  __syncthreads();  // every thread has read sm_red
  if (lane == 0) sm_red[warp] = lt;
  __syncthreads();
  lt = 0.f;
#pragma unroll
  for (int w = 0; w < CNT / 32; ++w) lt += sm_red[w];
  const float inv = lt > 0.f ? 1.f / lt : 0.f;
  sm_w[tid] = a * inv;
  __syncthreads();
  const float* po = ws_o + row * n_split * DH;
  for (int d = tid * 2; d < DH; d += 2 * CNT) {
    float o0 = 0.f, o1 = 0.f;
#pragma unroll 8
    for (int s = 0; s < n_act; ++s) {
      const float2 p = *reinterpret_cast<const float2*>(po + (size_t)s * DH + d);
      o0 = fmaf(sm_w[s], p.x, o0);
      o1 = fmaf(sm_w[s], p.y, o1);
    }
    store2(O + row * DH + d, o0, o1);
  }
}
