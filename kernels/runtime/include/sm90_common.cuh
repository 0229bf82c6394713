// Hopper (sm_90a) helpers shared by the wgmma kernels (gemm_sm90.cu, attn_fwd_sm90.cu):
// shared-memory matrix descriptors, mbarriers, named barriers, wgmma fences and waits.
// Inline PTX, no CUDA headers; kernels/runtime/_module.py inlines `#include "x.cuh"` (each once).
#pragma once

typedef unsigned int u32;
typedef unsigned long long u64;

// SW128 (128-byte swizzle) shared-memory matrix descriptor for wgmma.
__device__ __forceinline__ u64 make_desc(u32 saddr, u32 lbo, u32 sbo) {
  u64 d = (u64)((saddr & 0x3FFFF) >> 4);
  d |= (u64)((lbo >> 4) & 0x3FFF) << 16;
  d |= (u64)((sbo >> 4) & 0x3FFF) << 32;
  d |= (u64)1 << 62;  // 128-byte swizzle
  return d;
}

// ---- mbarriers (shared::cta) ----
__device__ __forceinline__ void mbar_init(u32 addr, u32 count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(addr), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(u32 addr) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(addr) : "memory");
}
// Arrive and expect `bytes` of TMA transactions on the barrier.
__device__ __forceinline__ void mbar_arrive_tx(u32 addr, u32 bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(addr), "r"(bytes) : "memory");
}
// Arrive once all of this thread's earlier cp.async copies have landed (count not raised).
__device__ __forceinline__ void mbar_arrive_cp_async(u32 addr) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(addr) : "memory");
}
__device__ __forceinline__ void mbar_wait(u32 addr, u32 parity) {
  asm volatile(
      "{\n.reg .pred P1;\nLAB_WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 P1, [%0], %1;\n"
      "@P1 bra DONE;\nbra LAB_WAIT;\nDONE:\n}\n" ::"r"(addr),
      "r"(parity)
      : "memory");
}

// ---- named barriers (0 is __syncthreads) ----
__device__ __forceinline__ void named_sync(int id, int n) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(n) : "memory");
}
__device__ __forceinline__ void named_arrive(int id, int n) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(n) : "memory");
}

// ---- wgmma ordering ----
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Keep the compiler from moving accumulator accesses across a wgmma fence/wait.
template <int N>
__device__ __forceinline__ void fence_regs(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
template <int N>
__device__ __forceinline__ void fence_regs(u32 (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+r"(r[i])::"memory");
}
