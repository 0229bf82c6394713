// Quantized-weight GEMV and dequantization: GGUF blocks (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K)
// dequantized in registers, float32 accumulation. The block layouts are those of
// kernels/quant/_formats.py (ggml's); kernels/quant/_dequant_np.py is the same arithmetic in
// NumPy.
//
// The weight: an (N, K) matrix as N rows of K/block GGUF blocks, each row's bytes padded to a
// multiple of 16 (w_stride bytes apart; every row starts 16-byte aligned). The unit of work is
// 32 consecutive elements of a row: a whole block of the 32-element formats, a sub-block of the
// K-quants' 256-element super-blocks (Q4_K: one scale/min pair; Q6_K: two 16-element scales).
// unit<F>(row, u, w) dequantizes unit u of a row into w[32] (the row's order).
//
// quant_gemv<F, MR, T>: out[m0 + r, out_col + n] = sum_k x[m0 + r, k] W[n, k] (+ bias[n]),
// r < min(MR, M - m0), m0 = blockIdx.y MR. One warp per weight row n (QG_WARPS rows a block):
// lane l dequantizes units l, l + 32, ... of the row (consecutive lanes read consecutive
// blocks: a warp reads its row front to back, each unit once) and multiplies each with the
// MR activation rows (16-byte loads of x when x_vec); the MR sums are reduced over the warp
// by shuffles, lane r writes row r. x and out: T = float, f16 or bf16 (float16_types.cuh).
//
// quant_dequant<F, T>: out[i, :] = W[row_i, :] dequantized, row_i = i (ids null), else the
// clamped id (id_kind 1: int32, 2: int64). Blocks stride over rows, threads over units.
#include "float16_types.cuh"

#define QF_Q4_0 0
#define QF_Q4_1 1
#define QF_Q5_0 2
#define QF_Q8_0 3
#define QF_Q4_K 4
#define QF_Q6_K 5

#ifndef QG_WARPS
#define QG_WARPS 4
#endif

typedef unsigned char u8;
typedef unsigned int u32;
typedef unsigned short u16;

__device__ __forceinline__ float half_bits(u32 h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"((u16)h));
  return f;
}
__device__ __forceinline__ u32 ld16(const u8* p) { return (u32)__ldg(reinterpret_cast<const u16*>(p)); }
__device__ __forceinline__ u32 ld32(const u8* p) { return __ldg(reinterpret_cast<const u32*>(p)); }

// 16 bytes at a 2-byte aligned address, as 4 little-endian words
__device__ __forceinline__ void ld16B_a2(const u8* p, u32 (&q)[4]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) q[i] = ld16(p + 4 * i) | (ld16(p + 4 * i + 2) << 16);
}
__device__ __forceinline__ void ld16B_a16(const u8* p, u32 (&q)[4]) {
  const uint4 v = __ldg(reinterpret_cast<const uint4*>(p));
  q[0] = v.x; q[1] = v.y; q[2] = v.z; q[3] = v.w;
}
__device__ __forceinline__ u32 byte_of(const u32 (&q)[4], int j) { return (q[j >> 2] >> (8 * (j & 3))) & 0xFFu; }

// 16 packed 4-bit pairs: w[j] = lo nibble of byte j, w[j + 16] = hi nibble
__device__ __forceinline__ void nibbles16(const u32 (&q)[4], float (&w)[32], float d, float add) {
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    const u32 b = byte_of(q, j);
    w[j] = fmaf((float)(b & 0xFu), d, add);
    w[j + 16] = fmaf((float)(b >> 4), d, add);
  }
}

template <int F>
__device__ __forceinline__ void unit(const u8* __restrict__ row, int u, float (&w)[32]);

template <>
__device__ __forceinline__ void unit<QF_Q4_0>(const u8* __restrict__ row, int u, float (&w)[32]) {
  const u8* b = row + 18 * u;  // 2-byte aligned
  const float d = half_bits(ld16(b));
  u32 q[4];
  ld16B_a2(b + 2, q);
  nibbles16(q, w, d, -8.f * d);  // (q - 8) d
}

template <>
__device__ __forceinline__ void unit<QF_Q4_1>(const u8* __restrict__ row, int u, float (&w)[32]) {
  const u8* b = row + 20 * u;  // 4-byte aligned
  const u32 dm = ld32(b);
  u32 q[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) q[i] = ld32(b + 4 + 4 * i);
  nibbles16(q, w, half_bits(dm & 0xFFFFu), half_bits(dm >> 16));  // q d + m
}

template <>
__device__ __forceinline__ void unit<QF_Q5_0>(const u8* __restrict__ row, int u, float (&w)[32]) {
  const u8* b = row + 22 * u;  // 2-byte aligned
  const float d = half_bits(ld16(b));
  const u32 qh = ld16(b + 2) | (ld16(b + 4) << 16);
  u32 q[4];
  ld16B_a2(b + 6, q);
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    const u32 by = byte_of(q, j);
    const int lo = (int)((by & 0xFu) | (((qh >> j) & 1u) << 4)) - 16;
    const int hi = (int)((by >> 4) | (((qh >> (j + 16)) & 1u) << 4)) - 16;
    w[j] = (float)lo * d;
    w[j + 16] = (float)hi * d;
  }
}

template <>
__device__ __forceinline__ void unit<QF_Q8_0>(const u8* __restrict__ row, int u, float (&w)[32]) {
  const u8* b = row + 34 * u;  // 2-byte aligned
  const float d = half_bits(ld16(b));
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const u32 v = ld16(b + 2 + 2 * i);
    w[2 * i] = (float)(signed char)(v & 0xFFu) * d;
    w[2 * i + 1] = (float)(signed char)(v >> 8) * d;
  }
}

template <>
__device__ __forceinline__ void unit<QF_Q4_K>(const u8* __restrict__ row, int u, float (&w)[32]) {
  const u8* b = row + 144 * (u >> 3);  // 16-byte aligned (144 = 9 x 16)
  const int j = u & 7;                 // sub-block: scale/min pair j
  const u32 dd = ld32(b);
  const float d = half_bits(dd & 0xFFFFu), dmin = half_bits(dd >> 16);
  u32 s[3];
#pragma unroll
  for (int i = 0; i < 3; ++i) s[i] = ld32(b + 4 + 4 * i);
  auto sb = [&](int i) -> u32 { return (s[i >> 2] >> (8 * (i & 3))) & 0xFFu; };
  u32 sc, mn;
  if (j < 4) {
    sc = sb(j) & 63u;
    mn = sb(j + 4) & 63u;
  } else {
    sc = (sb(j + 4) & 0xFu) | ((sb(j - 4) >> 6) << 4);
    mn = (sb(j + 4) >> 4) | ((sb(j) >> 6) << 4);
  }
  const float d1 = d * (float)sc, m1 = dmin * (float)mn;
  const u8* qs = b + 16 + 32 * (j >> 1);  // 16-byte aligned; low nibbles for even j
  const int sh = 4 * (j & 1);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    u32 q[4];
    ld16B_a16(qs + 16 * h, q);
#pragma unroll
    for (int l = 0; l < 16; ++l) w[16 * h + l] = d1 * (float)((byte_of(q, l) >> sh) & 0xFu) - m1;
  }
}

template <>
__device__ __forceinline__ void unit<QF_Q6_K>(const u8* __restrict__ row, int u, float (&w)[32]) {
  const u8* b = row + 210 * (u >> 3);  // 2-byte aligned
  const int hh = (u >> 2) & 1, t = u & 3;  // elements 128 hh + 32 t + l
  const float d = half_bits(ld16(b + 208));
  const u32 scw = ld16(b + 192 + 8 * hh + 2 * t);
  const float d0 = d * (float)(signed char)(scw & 0xFFu), d1 = d * (float)(signed char)(scw >> 8);
  const u8* ql = b + 64 * hh + 32 * (t & 1);
  const u8* qh = b + 128 + 32 * hh;
  const int lsh = t < 2 ? 0 : 4, hsh = 2 * t;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    u32 lq[4], hq[4];
    ld16B_a2(ql + 16 * h, lq);
    ld16B_a2(qh + 16 * h, hq);
#pragma unroll
    for (int l = 0; l < 16; ++l) {
      const int q = (int)(((byte_of(lq, l) >> lsh) & 0xFu) | (((byte_of(hq, l) >> hsh) & 3u) << 4)) - 32;
      w[16 * h + l] = (h ? d1 : d0) * (float)q;
    }
  }
}

// 8 activations at p (as float); vec: one 16-byte load (f16/bf16) or two (float)
__device__ __forceinline__ void load_x8(const f16* p, float (&v)[8], int vec) {
  if (vec) {
    const uint4 q = __ldg(reinterpret_cast<const uint4*>(p));
    const u32 a[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      v[2 * i] = half_bits(a[i] & 0xFFFFu);
      v[2 * i + 1] = half_bits(a[i] >> 16);
    }
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = ld(p[i]);
  }
}
__device__ __forceinline__ void load_x8(const bf16* p, float (&v)[8], int vec) {
  if (vec) {
    const uint4 q = __ldg(reinterpret_cast<const uint4*>(p));
    const u32 a[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      v[2 * i] = __uint_as_float(a[i] << 16);
      v[2 * i + 1] = __uint_as_float(a[i] & 0xFFFF0000u);
    }
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = ld(p[i]);
  }
}
__device__ __forceinline__ void load_x8(const float* p, float (&v)[8], int vec) {
  if (vec) {
    const float4 a = __ldg(reinterpret_cast<const float4*>(p));
    const float4 c = __ldg(reinterpret_cast<const float4*>(p + 4));
    v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
    v[4] = c.x; v[5] = c.y; v[6] = c.z; v[7] = c.w;
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = p[i];
  }
}

template <int F, int MR, typename T>
__global__ void __launch_bounds__(QG_WARPS * 32)
    quant_gemv(const u8* __restrict__ W, long long w_stride, const T* __restrict__ X, T* __restrict__ out,
               const T* __restrict__ bias, int M, int N, int K, int ldo, int out_col, int has_bias, int x_vec) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int n = blockIdx.x * QG_WARPS + warp;
  if (n >= N) return;  // (no block-wide barrier below)
  const int m0 = blockIdx.y * MR;
  const int rows = min(MR, M - m0);
  const u8* row = W + (size_t)n * (size_t)w_stride;
  const T* Xb = X + (size_t)m0 * K;
  float acc[MR];
#pragma unroll
  for (int r = 0; r < MR; ++r) acc[r] = 0.f;
  const int units = K >> 5;
  for (int u = lane; u < units; u += 32) {
    float w[32];
    unit<F>(row, u, w);
#pragma unroll
    for (int r = 0; r < MR; ++r) {
      if (r < rows) {
        const T* xp = Xb + (size_t)r * K + 32 * u;
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          float xv[8];
          load_x8(xp + 8 * c, xv, x_vec);
#pragma unroll
          for (int i = 0; i < 8; ++i) acc[r] = fmaf(xv[i], w[8 * c + i], acc[r]);
        }
      }
    }
  }
#pragma unroll
  for (int r = 0; r < MR; ++r) {
    if (r < rows) {  // (uniform over the warp)
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], o);
    }
  }
  const float bv = has_bias ? ld(bias[n]) : 0.f;
#pragma unroll
  for (int r = 0; r < MR; ++r) {
    if (r < rows && lane == (r & 31)) st(out[(size_t)(m0 + r) * ldo + out_col + n], acc[r] + bv);
  }
}

template <int F, typename T>
__global__ void __launch_bounds__(128)
    quant_dequant(const u8* __restrict__ W, long long w_stride, const void* __restrict__ ids, int id_kind,
                  T* __restrict__ out, long long n_out, long long n_rows, int K) {
  const int units = K >> 5;
  for (long long i = blockIdx.x; i < n_out; i += gridDim.x) {
    long long r = i;
    if (id_kind == 1) r = (long long)reinterpret_cast<const int*>(ids)[i];
    else if (id_kind == 2) r = reinterpret_cast<const long long*>(ids)[i];
    r = r < 0 ? 0 : (r >= n_rows ? n_rows - 1 : r);
    const u8* row = W + (size_t)r * (size_t)w_stride;
    T* o = out + (size_t)i * K;
    for (int u = threadIdx.x; u < units; u += blockDim.x) {
      float w[32];
      unit<F>(row, u, w);
#pragma unroll
      for (int j = 0; j < 32; ++j) st(o[32 * u + j], w[j]);
    }
  }
}
