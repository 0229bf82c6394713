// Helpers of the row-wise and vector kernels (norms, activations, lookup, transformer,
// sampling): warp/block reductions, the row loop, rounding to a storage type and 16-byte
// vector loads/stores. Inlined by kernels/runtime/_module.expanded_source (each header once).
//
// Row-wise launch shape: a tensor is seen as (rows, cols) = (prod(shape[:-1]), shape[-1]).
// `tpr` threads handle one row: tpr == 32 means one warp per row (blockDim.x / 32 rows per
// block; rows up to ~1k elements), tpr == blockDim.x one block per row (long rows).
// Reductions are warp shuffles, then (block mode) one shared-memory step across warps.
// Blocks stride over the rows, so any row count works with any grid. Any cols >= 1.

#include "float16_types.cuh"

#define NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over the `tpr` threads of a row; every one of them gets the total.
__device__ __forceinline__ float group_sum(float v, int tpr, float* sh) {
    v = warp_sum(v);
    if (tpr == 32) return v;
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    __syncthreads();  // a previous reduction may still be reading sh
    if (lane == 0) sh[w] = v;
    __syncthreads();
    return warp_sum(lane < nw ? sh[lane] : 0.f);
}

__device__ __forceinline__ float group_max(float v, int tpr, float* sh) {
    v = warp_max(v);
    if (tpr == 32) return v;
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    __syncthreads();
    if (lane == 0) sh[w] = v;
    __syncthreads();
    return warp_max(lane < nw ? sh[lane] : NEG_INF);
}

#define ROW_LOOP                                                                          \
    __shared__ float sh[32];                                                              \
    const int rpb = blockDim.x / tpr;                                                     \
    const int t = threadIdx.x % tpr;                                                      \
    for (long long base = (long long)blockIdx.x * rpb; base < rows;                       \
         base += (long long)gridDim.x * rpb) {                                            \
        const long long r = base + threadIdx.x / tpr;                                     \
        if (r >= rows) continue; /* whole warps only (warp mode); never in block mode */  \
        const T* xr = x + r * cols;                                                       \
        T* orow = out + r * cols;

// The value as stored in T (float -> T -> float), for sums that must see the rounded value.
template <typename T>
__device__ __forceinline__ float round_to(float v) {
    T t;
    st(t, v);
    return ld(t);
}

// N elements of T at p (16-byte aligned when sizeof(T) * N == 16) as floats, and back.
template <typename T, int N>
__device__ __forceinline__ void load_vec(float (&f)[N], const T* p) {
    if constexpr (sizeof(T) * N == 16) {
        const uint4 u = *reinterpret_cast<const uint4*>(p);
        const T* e = reinterpret_cast<const T*>(&u);
#pragma unroll
        for (int k = 0; k < N; ++k) f[k] = ld(e[k]);
    } else {
#pragma unroll
        for (int k = 0; k < N; ++k) f[k] = ld(p[k]);
    }
}

template <typename T, int N>
__device__ __forceinline__ void store_vec(T* p, const float (&f)[N]) {
    if constexpr (sizeof(T) * N == 16) {
        uint4 u;
        T* e = reinterpret_cast<T*>(&u);
#pragma unroll
        for (int k = 0; k < N; ++k) st(e[k], f[k]);
        *reinterpret_cast<uint4*>(p) = u;
    } else {
#pragma unroll
        for (int k = 0; k < N; ++k) st(p[k], f[k]);
    }
}

// Sum over the block; every thread gets the total. `sh` holds 32 floats; safe to call
// repeatedly (the leading barrier protects the previous call's reads).
__device__ __forceinline__ float block_sum(float v, float* sh) {
    v = warp_sum(v);
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    __syncthreads();
    if (lane == 0) sh[w] = v;
    __syncthreads();
    return warp_sum(lane < nw ? sh[lane] : 0.f);
}

// Arg-reductions over (value, index) pairs. An order is a type with
//   static bool first(float v, int i, float bv, int bi): does (v, i) come before (bv, bi)?
// The identity of both orders below is (NEG_INF, 0x7fffffff): every real item comes first.

// NumPy's argmax order: NaN is the largest value; ties go to the lower index.
struct ArgmaxOrder {
    static __device__ __forceinline__ bool first(float v, int i, float bv, int bi) {
        const bool vn = v != v, bn = bv != bv;
        if (vn || bn) return vn && (!bn || i < bi);
        return v > bv || (v == bv && i < bi);
    }
};

// Value descending, index ascending (no NaN handling: callers exclude NaN).
struct DescendingOrder {
    static __device__ __forceinline__ bool first(float v, int i, float bv, int bi) {
        return v > bv || (v == bv && i < bi);
    }
};

// Every lane of the warp gets the warp's first (v, i) under Order.
template <typename Order>
__device__ __forceinline__ void warp_first(float& v, int& i) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, v, o);
        const int oi = __shfl_xor_sync(0xffffffffu, i, o);
        if (Order::first(ov, oi, v, i)) { v = ov; i = oi; }
    }
}

// The first (v, i) under Order over the `tpr` threads of a row (tpr == 32: the warp;
// otherwise the whole block); every one of them gets it. `shv`, `shi`: 32 each; safe to call
// repeatedly (the leading barrier protects the previous call's reads).
template <typename Order>
__device__ __forceinline__ void group_first(float& v, int& i, int tpr, float* shv, int* shi) {
    warp_first<Order>(v, i);
    if (tpr == 32) return;
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    __syncthreads();
    if (lane == 0) { shv[w] = v; shi[w] = i; }
    __syncthreads();
    v = lane < nw ? shv[lane] : NEG_INF;
    i = lane < nw ? shi[lane] : 0x7fffffff;
    warp_first<Order>(v, i);
}
