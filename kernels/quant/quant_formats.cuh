// GGUF block formats dequantized in registers (kernels/quant/_plan.py gives the layouts;
// dequantize_blocks in kernels/quant/_cpu.py is the same arithmetic in NumPy). Included by quant_gemv.cu;
// tests/test_quant_host.py compiles this header for the host (QUANT_HOST defined, with shims
// for __ldg and uint4) and checks every format against NumPy, so it uses no other CUDA.
//
// A weight row is K/block blocks, 16-byte aligned (rows padded to 16 bytes). The unit of work
// is 32 consecutive elements of a row: a whole block of Q4_0/Q4_1/Q5_0/Q8_0, a sub-block of
// the 256-element super-blocks of Q4_K (one 6-bit scale/min pair) and Q6_K (two 16-element
// int8 scales). Raw<F> holds one unit's bytes in registers: load(row, u) issues its loads
// (so a thread can have several units' loads in flight before using any), deq(w) turns them
// into the unit's 32 floats in the row's order.
#pragma once

#define QF_Q4_0 0
#define QF_Q4_1 1
#define QF_Q5_0 2
#define QF_Q8_0 3
#define QF_Q4_K 4
#define QF_Q6_K 5

typedef unsigned char u8;
typedef unsigned int u32;
typedef unsigned short u16;

#ifdef QUANT_HOST
float half_bits(u32 h);  // (the host test's IEEE half -> float)
#else
__device__ __forceinline__ float half_bits(u32 h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"((u16)h));
  return f;
}
#endif
__device__ __forceinline__ u32 ld16(const u8* p) { return (u32)__ldg(reinterpret_cast<const u16*>(p)); }
__device__ __forceinline__ u32 ld32(const u8* p) { return __ldg(reinterpret_cast<const u32*>(p)); }

// n bytes (a multiple of 4) at a 2-byte aligned address, as little-endian words
template <int NW>
__device__ __forceinline__ void ld_a2(const u8* p, u32 (&q)[NW]) {
#pragma unroll
  for (int i = 0; i < NW; ++i) q[i] = ld16(p + 4 * i) | (ld16(p + 4 * i + 2) << 16);
}
__device__ __forceinline__ void ld_a16(const u8* p, u32* q) {  // 16 bytes, 16-byte aligned
  const uint4 v = __ldg(reinterpret_cast<const uint4*>(p));
  q[0] = v.x;
  q[1] = v.y;
  q[2] = v.z;
  q[3] = v.w;
}
template <int NW>
__device__ __forceinline__ u32 byte_of(const u32 (&q)[NW], int j) { return (q[j >> 2] >> (8 * (j & 3))) & 0xFFu; }

// 16 packed 4-bit pairs: w[j] = (lo nibble of byte j) d + add, w[j + 16] = (hi nibble) d + add
__device__ __forceinline__ void nibbles16(const u32 (&q)[4], float (&w)[32], float d, float add) {
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    const u32 b = byte_of(q, j);
    w[j] = fmaf((float)(b & 0xFu), d, add);
    w[j + 16] = fmaf((float)(b >> 4), d, add);
  }
}

template <int F>
struct Raw;

template <>
struct Raw<QF_Q4_0> {  // 18 bytes: d, qs[16]; (q - 8) d
  u32 d, q[4];
  __device__ __forceinline__ void load(const u8* __restrict__ row, int u) {
    const u8* b = row + 18 * u;  // 2-byte aligned
    d = ld16(b);
    ld_a2(b + 2, q);
  }
  __device__ __forceinline__ void deq(float (&w)[32]) const {
    const float df = half_bits(d);
    nibbles16(q, w, df, -8.f * df);  // fma(q, d, -8 d) = (q - 8) d exactly
  }
};

template <>
struct Raw<QF_Q4_1> {  // 20 bytes: d, m, qs[16]; q d + m
  u32 dm, q[4];
  __device__ __forceinline__ void load(const u8* __restrict__ row, int u) {
    const u8* b = row + 20 * u;  // 4-byte aligned
    dm = ld32(b);
#pragma unroll
    for (int i = 0; i < 4; ++i) q[i] = ld32(b + 4 + 4 * i);
  }
  __device__ __forceinline__ void deq(float (&w)[32]) const {
    nibbles16(q, w, half_bits(dm & 0xFFFFu), half_bits(dm >> 16));
  }
};

template <>
struct Raw<QF_Q5_0> {  // 22 bytes: d, qh[4], qs[16]; ((q | h << 4) - 16) d
  u32 d, qh, q[4];
  __device__ __forceinline__ void load(const u8* __restrict__ row, int u) {
    const u8* b = row + 22 * u;  // 2-byte aligned
    d = ld16(b);
    qh = ld16(b + 2) | (ld16(b + 4) << 16);
    ld_a2(b + 6, q);
  }
  __device__ __forceinline__ void deq(float (&w)[32]) const {
    const float df = half_bits(d);
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      const u32 by = byte_of(q, j);
      const int lo = (int)((by & 0xFu) | (((qh >> j) & 1u) << 4)) - 16;
      const int hi = (int)((by >> 4) | (((qh >> (j + 16)) & 1u) << 4)) - 16;
      w[j] = (float)lo * df;
      w[j + 16] = (float)hi * df;
    }
  }
};

template <>
struct Raw<QF_Q8_0> {  // 34 bytes: d, qs[32] int8; q d
  u32 d, q[8];
  __device__ __forceinline__ void load(const u8* __restrict__ row, int u) {
    const u8* b = row + 34 * u;  // 2-byte aligned
    d = ld16(b);
    ld_a2(b + 2, q);
  }
  __device__ __forceinline__ void deq(float (&w)[32]) const {
    const float df = half_bits(d);
#pragma unroll
    for (int j = 0; j < 32; ++j) w[j] = (float)(signed char)byte_of(q, j) * df;
  }
};

template <>
struct Raw<QF_Q4_K> {  // 144-byte super-block: d, dmin, scales[12], qs[128]; sub-block j of 8
  u32 dd, sc, mn, sh, q[8];
  __device__ __forceinline__ void load(const u8* __restrict__ row, int u) {
    const u8* b = row + 144 * (u >> 3);  // 16-byte aligned (144 = 9 x 16)
    const int j = u & 7;
    dd = ld32(b);
    const u32 s0 = ld32(b + 4), s1 = ld32(b + 8), s2 = ld32(b + 12);  // scales[0..3], [4..7], [8..11]
    const u32 js = 8 * (j & 3);  // get_scale_min_k4(j), by shifts (no indexed register array)
    if (j < 4) {
      sc = (s0 >> js) & 63u;
      mn = (s1 >> js) & 63u;
    } else {
      sc = ((s2 >> js) & 0xFu) | (((s0 >> js) >> 6 & 3u) << 4);
      mn = ((s2 >> js) >> 4 & 0xFu) | (((s1 >> js) >> 6 & 3u) << 4);
    }
    sh = 4 * (j & 1);
    const u8* qs = b + 16 + 32 * (j >> 1);  // 32 bytes: sub-blocks 2i (low nibbles), 2i + 1 (high)
    ld_a16(qs, q);
    ld_a16(qs + 16, q + 4);
  }
  __device__ __forceinline__ void deq(float (&w)[32]) const {
    const float d1 = half_bits(dd & 0xFFFFu) * (float)sc, m1 = half_bits(dd >> 16) * (float)mn;
#pragma unroll
    for (int l = 0; l < 32; ++l) w[l] = d1 * (float)((byte_of(q, l) >> sh) & 0xFu) - m1;
  }
};

template <>
struct Raw<QF_Q6_K> {  // 210-byte super-block: ql[128], qh[64], scales[16] int8, d
  // unit u: elements 128 h + 32 t + l (h = (u >> 2) & 1, t = u & 3, l < 32):
  // q = (ql[64 h + 32 (t & 1) + l] nibble (low for t < 2) | ((qh[32 h + l] >> 2 t) & 3) << 4) - 32,
  // times d sc[8 h + 2 t + l / 16]
  u32 d, scw, lq[8], hq[8];
  int t;
  __device__ __forceinline__ void load(const u8* __restrict__ row, int u) {
    const u8* b = row + 210 * (u >> 3);  // 2-byte aligned
    const int h = (u >> 2) & 1;
    t = u & 3;
    d = ld16(b + 208);
    scw = ld16(b + 192 + 8 * h + 2 * t);
    ld_a2(b + 64 * h + 32 * (t & 1), lq);
    ld_a2(b + 128 + 32 * h, hq);
  }
  __device__ __forceinline__ void deq(float (&w)[32]) const {
    const float df = half_bits(d);
    const float d0 = df * (float)(signed char)(scw & 0xFFu), d1 = df * (float)(signed char)(scw >> 8);
    const int lsh = t < 2 ? 0 : 4, hsh = 2 * t;
#pragma unroll
    for (int l = 0; l < 32; ++l) {
      const int q = (int)(((byte_of(lq, l) >> lsh) & 0xFu) | (((byte_of(hq, l) >> hsh) & 3u) << 4)) - 32;
      w[l] = (l < 16 ? d0 : d1) * (float)q;
    }
  }
};

// unit u of a row, dequantized
template <int F>
__device__ __forceinline__ void unit(const u8* __restrict__ row, int u, float (&w)[32]) {
  Raw<F> r;
  r.load(row, u);
  r.deq(w);
}
