// Shared helpers for the deviceops GEMM kernels (inline PTX, no CUDA headers).
// Compiled by NVRTC through CuPy; kernels/runtime/_module.py inlines `#include "x.cuh"`.
//
// Epilogue (every kernel, every path):
//   out[b, m, n] = act(alpha * sum_k a[b, m, k] * b[(b,) k, n] + beta * out_prev[b, m, n] + bias[n])
// out_prev is read only when HAS_BETA (beta != 0), so a poisoned output never leaks in.
// act: 0 none, 1 relu, 2 gelu (tanh approximation), 3 silu, 4 gelu_erf (exact GELU).
#pragma once

#include "ptx_common.cuh"

typedef unsigned short u16;

#ifndef GEMM_BF16
#define GEMM_BF16 0
#endif

#define ACT_NONE 0
#define ACT_RELU 1
#define ACT_GELU 2
#define ACT_SILU 3
#define ACT_GELU_ERF 4

// 16-bit storage element (float16 or bfloat16 per GEMM_BF16) <-> float.
__device__ __forceinline__ float h2f(u16 x) {
#if GEMM_BF16
  return __uint_as_float(((u32)x) << 16);
#else
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x));
  return f;
#endif
}
// Two floats -> packed pair (lo in the low half), round to nearest even.
__device__ __forceinline__ u32 pack2(float lo, float hi) {
  u32 r;
#if GEMM_BF16
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#else
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#endif
  return r;
}
__device__ __forceinline__ u16 f2h(float x) { return (u16)(pack2(x, 0.f) & 0xFFFFu); }

__device__ __forceinline__ float apply_act(float x, int act) {
  if (act == ACT_RELU) return fmaxf(x, 0.f);
  if (act == ACT_GELU) {
    const float u = 0.7978845608028654f * fmaf(0.044715f * x * x, x, x);
    return 0.5f * x * (1.f + tanhf(u));
  }
  if (act == ACT_SILU) return x / (1.f + expf(-x));
  if (act == ACT_GELU_ERF) return 0.5f * x * (1.f + erff(x * 0.7071067811865476f));
  return x;
}

struct Epi {
  float alpha, beta;
  int act, has_bias, has_beta;
};

// v = act(alpha * acc + beta * prev + bias)
__device__ __forceinline__ float epi_apply(const Epi& e, float acc, float prev, float bias) {
  float v = e.alpha * acc;
  if (e.has_beta) v = fmaf(e.beta, prev, v);
  v += bias;
  return apply_act(v, e.act);
}

// ---- async-copy helpers (mbarriers: sm90_common.cuh) ----
__device__ __forceinline__ void cp_async4(u32 dst, const void* src, bool pred) {
  int sz = pred ? 4 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(sz) : "memory");
}

// One m16n8k16 tensor-core MMA (16-bit inputs per GEMM_BF16, float32 accumulators), sm_80+.
__device__ __forceinline__ void mma16816(float (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  asm volatile(
#if GEMM_BF16
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
#else
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
#endif
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
