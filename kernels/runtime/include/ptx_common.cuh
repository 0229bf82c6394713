// PTX helpers shared by every deviceops kernel family (attn_common.cuh, gemm_common.cuh):
// shared-memory addresses and cp.async (sm_80+). Inline PTX, no CUDA headers;
// kernels/runtime/_module.py inlines `#include "x.cuh"` (each header once).
#pragma once

typedef unsigned int u32;
typedef unsigned long long u64;

__device__ __forceinline__ u32 smem_u32(const void* p) {
  u32 r;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(r) : "l"(p));
  return r;
}

// 16-byte global->shared async copy; pred false (src_bytes 0) zero-fills the destination.
__device__ __forceinline__ void cp_async16(u32 dst, const void* src, bool pred) {
  int sz = pred ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(sz) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Thread-block clusters (sm_90+). cluster_barrier: every thread of every block of the cluster
// arrives (release) and waits (acquire), so shared-memory writes before it are visible to
// all blocks after it; it is also a block-wide barrier. ld_cluster_f32: a float in the
// shared memory of cluster block `rank` (distributed shared memory), `p` being the same
// variable in this block. cluster_rank: this block's rank in its cluster.
__device__ __forceinline__ void cluster_barrier() {
#if __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
#else
  __syncthreads();
#endif
}

__device__ __forceinline__ float ld_cluster_f32(const float* p, u32 rank) {
#if __CUDA_ARCH__ >= 900
  u32 addr;
  float v;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(addr) : "r"(smem_u32(p)), "r"(rank));
  asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(addr) : "memory");
  return v;
#else
  return *p;
#endif
}

__device__ __forceinline__ u32 cluster_rank() {
#if __CUDA_ARCH__ >= 900
  u32 r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
#else
  return 0;
#endif
}

// Programmatic dependent launch controls: pdl_wait blocks until the grids this one depends
// on have completed and their memory is visible (call it before the first global access);
// pdl_launch_dependents lets the next PDL-launched grid begin launching. No-ops when the
// kernel was launched without the attribute, compiled out below sm_90.
__device__ __forceinline__ void pdl_wait() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_launch_dependents() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
