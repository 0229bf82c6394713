// Shared helpers for the deviceops flash-attention kernels (inline PTX, no headers).
// Compiled by NVRTC through CuPy; kernels/runtime/_module.py inlines `#include "x.cuh"`.
#pragma once

#include "ptx_common.cuh"

#ifndef ATTN_BF16
#define ATTN_BF16 0
#endif

#ifndef ATTN_F32
#define ATTN_F32 0
#endif

// Element type of q/k/v/o: 16-bit storage (float16 or bfloat16), or float32 (ATTN_F32=1,
// split-KV kernel only; pack2/unpack2 below are the 16-bit helpers).
#if ATTN_F32
typedef float elem_t;
#else
typedef unsigned short elem_t;
#endif

// Writes by the generic proxy (st.shared, cp.async) must be fenced before wgmma reads them.
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Pack two floats into a 16-bit pair (lo in bits 0..15).
__device__ __forceinline__ u32 pack2(float lo, float hi) {
  u32 r;
#if ATTN_BF16
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#else
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#endif
  return r;
}

// Unpack a 16-bit pair into two floats.
__device__ __forceinline__ void unpack2(u32 x, float& lo, float& hi) {
#if ATTN_BF16
  lo = __uint_as_float(x << 16);
  hi = __uint_as_float(x & 0xffff0000u);
#else
  asm("{ .reg .b16 l, h; mov.b32 {l, h}, %2; cvt.f32.f16 %0, l; cvt.f32.f16 %1, h; }"
      : "=f"(lo), "=f"(hi)
      : "r"(x));
#endif
}

#define ATTN_NEG_INF (-__int_as_float(0x7f800000))
