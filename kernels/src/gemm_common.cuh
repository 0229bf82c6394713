// Shared helpers for the deviceops GEMM kernels (inline PTX, no CUDA headers).
// Compiled by NVRTC through CuPy; kernels/_gemm.py inlines `#include "gemm_*.cuh"`.
//
// Epilogue (every kernel, every path):
//   out[b, m, n] = act(alpha * sum_k a[b, m, k] * b[(b,) k, n] + beta * out_prev[b, m, n] + bias[n])
// out_prev is read only when HAS_BETA (beta != 0), so a poisoned output never leaks in.
// act: 0 none, 1 relu, 2 gelu (tanh approximation), 3 silu.
#pragma once

typedef unsigned int u32;
typedef unsigned long long u64;
typedef unsigned short u16;

#ifndef GEMM_BF16
#define GEMM_BF16 0
#endif

#define ACT_NONE 0
#define ACT_RELU 1
#define ACT_GELU 2
#define ACT_SILU 3

__device__ __forceinline__ u32 smem_u32(const void* p) {
  u32 r;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(r) : "l"(p));
  return r;
}

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

// ---- mbarrier / async-copy helpers ----
__device__ __forceinline__ void mbar_init(u32 addr, u32 count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(addr), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(u32 addr) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(addr) : "memory");
}
__device__ __forceinline__ void mbar_arrive_tx(u32 addr, u32 bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(addr), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait(u32 addr, u32 parity) {
  asm volatile(
      "{\n.reg .pred P1;\nLAB_WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 P1, [%0], %1;\n"
      "@P1 bra DONE;\nbra LAB_WAIT;\nDONE:\n}\n" ::"r"(addr),
      "r"(parity)
      : "memory");
}

// 16-byte global->shared async copy; pred false zero-fills the destination.
__device__ __forceinline__ void cp_async16(u32 dst, const void* src, bool pred) {
  int sz = pred ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(sz) : "memory");
}
__device__ __forceinline__ void cp_async4(u32 dst, const void* src, bool pred) {
  int sz = pred ? 4 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(sz) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
