// Device helpers of attn_splitkv.cu (included by it after its compile-time parameters:
// ATTN_D, ATTN_GT, ATTN_F32, ATTN_BULK, ATTN_CL, NWARP, ... are defined there): 16-byte
// loads, the bulk copy of the K/V ring, eight-element rows, stores, the split geometry
// shared with the combine kernel, and the cluster merge of split partials.
#pragma once

__device__ __forceinline__ void ld_global16(const void* p, uint4& r) {
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "l"(p));
}

#if ATTN_BULK
// Bulk copy of `bytes` (a multiple of 16) from global to this block's shared memory; the
// transfer completes on mbarrier `bar` (which must expect the bytes).
__device__ __forceinline__ void bulk_g2s(u32 dst, const void* src, u32 bytes, u32 bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
      ::"r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}
#endif

// Eight consecutive elements of a row (16 bytes of 16-bit data, 32 bytes of float32).
struct Row8 {
  uint4 a;
#if ATTN_F32
  uint4 b;
#endif
};

__device__ __forceinline__ void zero8(Row8& r) {
  r.a = make_uint4(0, 0, 0, 0);
#if ATTN_F32
  r.b = make_uint4(0, 0, 0, 0);
#endif
}

__device__ __forceinline__ void ld8(const elem_t* p, Row8& r) {
  ld_global16(p, r.a);
#if ATTN_F32
  ld_global16(p + 4, r.b);
#endif
}

__device__ __forceinline__ void cvt8(const Row8& r, float (&f)[8]) {
#if ATTN_F32
  f[0] = __uint_as_float(r.a.x);
  f[1] = __uint_as_float(r.a.y);
  f[2] = __uint_as_float(r.a.z);
  f[3] = __uint_as_float(r.a.w);
  f[4] = __uint_as_float(r.b.x);
  f[5] = __uint_as_float(r.b.y);
  f[6] = __uint_as_float(r.b.z);
  f[7] = __uint_as_float(r.b.w);
#else
  unpack2(r.a.x, f[0], f[1]);
  unpack2(r.a.y, f[2], f[3]);
  unpack2(r.a.z, f[4], f[5]);
  unpack2(r.a.w, f[6], f[7]);
#endif
}

__device__ __forceinline__ void store1(elem_t* p, float x) {
#if ATTN_F32
  *p = x;
#else
  *p = (elem_t)(pack2(x, 0.f) & 0xffffu);
#endif
}

__device__ __forceinline__ void store2(elem_t* p, float x0, float x1) {
#if ATTN_F32
  *reinterpret_cast<float2*>(p) = make_float2(x0, x1);
#else
  *reinterpret_cast<u32*>(p) = pack2(x0, x1);
#endif
}

// Valid keys of batch row b.
__device__ __forceinline__ int valid_keys(const int* __restrict__ kv_len, int b, int Lk) {
  return kv_len == nullptr ? Lk : min(max(__ldg(kv_len + b), 0), Lk);
}

// Split of kvl keys into n_act <= n_split chunks of `chunk` keys (a multiple of the granule).
__device__ __forceinline__ void split_geometry(int kvl, int n_split, int& chunk, int& n_act) {
  if (n_split <= 1) {
    chunk = max(kvl, 1);
    n_act = 1;
    return;
  }
  int c = (kvl + n_split - 1) / n_split;
  c = max(ATTN_GRANULE, (c + ATTN_GRANULE - 1) / ATTN_GRANULE * ATTN_GRANULE);
  chunk = c;
  n_act = max(1, (kvl + c - 1) / c);
}

#if ATTN_CL > 1
// The cluster's merge of its ATTN_CL split partials (o[t][d] unnormalised against max m[t],
// sum l[t]) into the outputs of heads t < ng: row0 + t * Lq of O. Every block calls it.
__device__ __forceinline__ void cluster_merge(elem_t* __restrict__ O, float (&o)[NWARP][GT][DH],
                                              const float (&m)[GT], const float (&l)[GT], int ng,
                                              size_t row0, int Lq) {
  __shared__ float w[GT][ATTN_CL];  // each rank's weight in the merged row
  const u32 rank = cluster_rank();
  cluster_barrier();  // every block's partial is complete and visible cluster-wide
  if (threadIdx.x < ng) {
    const int t = threadIdx.x;
    float a[ATTN_CL], mx = ATTN_NEG_INF;
#pragma unroll
    for (int r = 0; r < ATTN_CL; ++r) {
      a[r] = ld_cluster_f32(&m[t], (u32)r);
      mx = fmaxf(mx, a[r]);
    }
    const float mu = mx == ATTN_NEG_INF ? 0.f : mx;  // no valid key anywhere: output 0
    float lt = 0.f;
#pragma unroll
    for (int r = 0; r < ATTN_CL; ++r) {
      a[r] = fast_exp2(a[r] - mu);
      lt += ld_cluster_f32(&l[t], (u32)r) * a[r];
    }
    const float inv = lt > 0.f ? 1.f / lt : 0.f;
#pragma unroll
    for (int r = 0; r < ATTN_CL; ++r) w[t][r] = a[r] * inv;
  }
  __syncthreads();
  for (int idx = rank + ATTN_CL * threadIdx.x; idx < ng * DH; idx += ATTN_CL * NWARP * 32) {
    const int t = idx / DH, d = idx % DH;
    float acc = 0.f;
#pragma unroll
    for (int r = 0; r < ATTN_CL; ++r) acc = fmaf(w[t][r], ld_cluster_f32(&o[0][t][d], (u32)r), acc);
    store1(O + (row0 + (size_t)t * Lq) * DH + d, acc);
  }
  cluster_barrier();  // no block exits while another still reads its shared memory
}
#endif
