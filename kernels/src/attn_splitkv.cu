// Split-KV flash attention on CUDA cores ("flash-decoding"): the fast path for few query rows
// (decode, Lq = 1) and the portable fallback for any shape on any sm_80+ GPU.
//
// Grid: x = ((i * Hkv + hk) * n_hchunk + hc)  (query position i, kv head hk, head chunk hc),
//       y = split (a contiguous range of `chunk` keys), z = batch.
// A block serves GT query heads that share kv head hk (GQA: heads hk*g .. hk*g+g-1), so each
// K/V row is read from memory once for all of them. 4 warps; a warp covers KPW keys per step,
// LPK lanes per key, each lane 8 head-dim elements (one 16-byte load of K and of V).
// Each lane group keeps its own running max / sum / accumulator (fp32); they are merged
// across the warp with shuffles and across warps in shared memory.
//   n_split == 1: the block writes the normalised output o (B, Hq, Lq, D).
//   n_split  > 1: it writes partials ws_o (B, Hq, Lq, n_split, D) and ws_ml (..., 2) = (m, l),
//                 base-2 max and sum; attn_splitkv_combine merges them.
//
// Compile-time parameters: ATTN_D (head dim, multiple of 8, <= 256), ATTN_GT (heads per
// block: 1/2/4/8), ATTN_BF16.
#include "attn_common.cuh"

#ifndef ATTN_D
#define ATTN_D 128
#endif
#ifndef ATTN_GT
#define ATTN_GT 4
#endif

#define DH ATTN_D
#define GT ATTN_GT
#define NCH (DH / 8)                                                       // 16-byte chunks per row
#define LPK (NCH <= 1 ? 1 : NCH <= 2 ? 2 : NCH <= 4 ? 4 : NCH <= 8 ? 8 : NCH <= 16 ? 16 : 32)  // lanes per key
#define KPW (32 / LPK)                                                     // keys per warp step
#ifndef ATTN_UK
#define ATTN_UK 4
#endif
#define UK ATTN_UK  // keys per lane group per step
#define NWARP 4

__device__ __forceinline__ void ld_global16(const void* p, uint4& r) {
  asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "l"(p));
}

extern "C" __global__ void __launch_bounds__(NWARP * 32)
attn_splitkv(const elem_t* __restrict__ Q,  // (B, Hq, Lq, D)
             const elem_t* __restrict__ K,  // (B, Hkv, Lk, D)
             const elem_t* __restrict__ V,  // (B, Hkv, Lk, D)
             elem_t* __restrict__ O,        // (B, Hq, Lq, D)
             float* __restrict__ ws_o,      // (B, Hq, Lq, n_split, D)
             float* __restrict__ ws_ml,     // (B, Hq, Lq, n_split, 2)
             int Hq, int Hkv, int Lq, int Lk, float scale_log2, int causal, int n_split, int chunk,
             int n_hchunk) {
  __shared__ float sm_m[NWARP][GT], sm_l[NWARP][GT];
  __shared__ float sm_o[NWARP][GT][DH];

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

  const int off = Lk - Lq;
  const int kend = causal ? min(Lk, i + off + 1) : Lk;
  const int ks = split * chunk;
  const int ke = min(kend, ks + chunk);

  // q for my chunk of the head dim, pre-scaled to base 2.
  float qf[GT][8];
#pragma unroll
  for (int t = 0; t < GT; ++t) {
    const int hq = h0 + (t < ng ? t : 0);
    uint4 r = make_uint4(0, 0, 0, 0);
    if (lane_ok) ld_global16(Q + (((size_t)b * Hq + hq) * Lq + i) * DH + sl * 8, r);
    unpack2(r.x, qf[t][0], qf[t][1]);
    unpack2(r.y, qf[t][2], qf[t][3]);
    unpack2(r.z, qf[t][4], qf[t][5]);
    unpack2(r.w, qf[t][6], qf[t][7]);
#pragma unroll
    for (int e = 0; e < 8; ++e) qf[t][e] *= scale_log2;
  }

  float m[GT], l[GT], acc[GT][8];
#pragma unroll
  for (int t = 0; t < GT; ++t) {
    m[t] = ATTN_NEG_INF;
    l[t] = 0.f;
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[t][e] = 0.f;
  }

  const elem_t* kb = K + ((size_t)b * Hkv + hk) * Lk * DH + sl * 8;
  const elem_t* vb = V + ((size_t)b * Hkv + hk) * Lk * DH + sl * 8;
  constexpr int STEP = NWARP * KPW * UK;
  // The loop bound is warp-uniform (shuffles below need the whole warp); keys past ke are masked.
  for (int wbase = ks + warp * KPW * UK; wbase < ke; wbase += STEP) {
    const int base = wbase + lg * UK;
    uint4 kr[UK], vr[UK];
#pragma unroll
    for (int u = 0; u < UK; ++u) {
      kr[u] = make_uint4(0, 0, 0, 0);
      vr[u] = make_uint4(0, 0, 0, 0);
      if (lane_ok && base + u < ke) {
        ld_global16(kb + (size_t)(base + u) * DH, kr[u]);
        ld_global16(vb + (size_t)(base + u) * DH, vr[u]);
      }
    }
    float sc[GT][UK];
#pragma unroll
    for (int u = 0; u < UK; ++u) {
      float kf[8];
      unpack2(kr[u].x, kf[0], kf[1]);
      unpack2(kr[u].y, kf[2], kf[3]);
      unpack2(kr[u].z, kf[4], kf[5]);
      unpack2(kr[u].w, kf[6], kf[7]);
#pragma unroll
      for (int t = 0; t < GT; ++t) {
        float d = 0.f;
#pragma unroll
        for (int e = 0; e < 8; ++e) d = fmaf(qf[t][e], kf[e], d);
        sc[t][u] = d;
      }
    }
#pragma unroll
    for (int t = 0; t < GT; ++t)
#pragma unroll
      for (int u = 0; u < UK; ++u) {
#pragma unroll
        for (int o = LPK / 2; o > 0; o >>= 1) sc[t][u] += __shfl_xor_sync(0xffffffffu, sc[t][u], o);
        if (base + u >= ke) sc[t][u] = ATTN_NEG_INF;
      }
    float vf[UK][8];
#pragma unroll
    for (int u = 0; u < UK; ++u) {
      unpack2(vr[u].x, vf[u][0], vf[u][1]);
      unpack2(vr[u].y, vf[u][2], vf[u][3]);
      unpack2(vr[u].z, vf[u][4], vf[u][5]);
      unpack2(vr[u].w, vf[u][6], vf[u][7]);
    }
#pragma unroll
    for (int t = 0; t < GT; ++t) {
      float mx = m[t];
#pragma unroll
      for (int u = 0; u < UK; ++u) mx = fmaxf(mx, sc[t][u]);
      const float mu = mx == ATTN_NEG_INF ? 0.f : mx;  // no valid key yet: keep everything 0
      const float alpha = fast_exp2(m[t] - mu);
      m[t] = mx;
      l[t] *= alpha;
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[t][e] *= alpha;
#pragma unroll
      for (int u = 0; u < UK; ++u) {
        const float pu = fast_exp2(sc[t][u] - mu);
        l[t] += pu;
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[t][e] = fmaf(pu, vf[u][e], acc[t][e]);
      }
    }
  }

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
    const size_t row = ((size_t)b * Hq + h0 + t) * Lq + i;
    if (n_split == 1) {
      const float r = lt > 0.f ? ot / lt : 0.f;
      u32 pk = pack2(r, 0.f);
      O[row * DH + d] = (elem_t)(pk & 0xffffu);
    } else {
      const size_t prow = row * n_split + split;
      ws_o[prow * DH + d] = ot;
      if (d == 0) {
        ws_ml[prow * 2] = mx;
        ws_ml[prow * 2 + 1] = lt;
      }
    }
  }
}

// Merge n_split partials per output row. Grid x = B * Hq * Lq rows; 64 threads.
extern "C" __global__ void __launch_bounds__(64)
attn_splitkv_combine(const float* __restrict__ ws_o, const float* __restrict__ ws_ml,
                     elem_t* __restrict__ O, int n_split) {
  const size_t row = blockIdx.x;
  float mx = ATTN_NEG_INF;
  for (int s = 0; s < n_split; ++s) mx = fmaxf(mx, ws_ml[(row * n_split + s) * 2]);
  const float mu = mx == ATTN_NEG_INF ? 0.f : mx;
  float lt = 0.f;
  for (int s = 0; s < n_split; ++s)
    lt += ws_ml[(row * n_split + s) * 2 + 1] * fast_exp2(ws_ml[(row * n_split + s) * 2] - mu);
  const float inv = lt > 0.f ? 1.f / lt : 0.f;
  for (int d = threadIdx.x * 2; d < DH; d += 128) {
    float o0 = 0.f, o1 = 0.f;
    for (int s = 0; s < n_split; ++s) {
      const float a = fast_exp2(ws_ml[(row * n_split + s) * 2] - mu);
      const float* p = ws_o + (row * n_split + s) * DH + d;
      o0 = fmaf(a, p[0], o0);
      o1 = fmaf(a, p[1], o1);
    }
    *reinterpret_cast<u32*>(O + row * DH + d) = pack2(o0 * inv, o1 * inv);
  }
}
