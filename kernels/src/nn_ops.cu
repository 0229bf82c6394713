// Neural-network kernels: layer_norm, softmax, argmax (row-wise over the last
// dim), gelu, silu (elementwise) and embedding (row gather).
//
// Storage types for the 16-bit floats are plain structs converted with PTX `cvt` (no
// cuda_fp16.h / cuda_bf16.h needed under NVRTC), as in elementwise.cu. Every kernel
// loads its inputs as float32, accumulates in float32 and rounds once on store.
//
// Row-wise launch shape: a tensor is seen as (rows, cols) = (prod(shape[:-1]), shape[-1]).
// `tpr` threads handle one row: tpr == 32 means one warp per row (blockDim.x / 32 rows per
// block; rows up to ~1k elements), tpr == blockDim.x one block per row (long rows).
// Reductions are warp shuffles, then (block mode) one shared-memory step across warps.
// Blocks stride over the rows, so any row count works with any grid. Any cols >= 1.
// In-place use (out == x) is allowed for the row-wise and elementwise kernels: every
// element is read by the thread that writes it, after every read of the reductions.

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

// out = (x - mean) / sqrt(var + eps) * w + b   (biased variance, two passes)
template <typename T>
__global__ void layer_norm(T* out, const T* x, const T* __restrict__ w, const T* __restrict__ b,
                           long long rows, int cols, float eps, int has_bias, int tpr) {
    ROW_LOOP
        float s = 0.f;
        for (int c = t; c < cols; c += tpr) s += ld(xr[c]);
        const float mean = group_sum(s, tpr, sh) / (float)cols;
        float ss = 0.f;
        for (int c = t; c < cols; c += tpr) {
            const float d = ld(xr[c]) - mean;
            ss += d * d;
        }
        const float inv = rsqrtf(group_sum(ss, tpr, sh) / (float)cols + eps);
        for (int c = t; c < cols; c += tpr) {
            float y = (ld(xr[c]) - mean) * inv * ld(w[c]);
            if (has_bias) y += ld(b[c]);
            st(orow[c], y);
        }
    }
}

// out = exp(x - max) / sum(exp(x - max))
template <typename T>
__global__ void softmax(T* out, const T* x, long long rows, int cols, int tpr) {
    ROW_LOOP
        float m = NEG_INF;
        for (int c = t; c < cols; c += tpr) m = fmaxf(m, ld(xr[c]));
        m = group_max(m, tpr, sh);
        float s = 0.f;
        for (int c = t; c < cols; c += tpr) s += expf(ld(xr[c]) - m);
        const float inv = 1.f / group_sum(s, tpr, sh);
        for (int c = t; c < cols; c += tpr) st(orow[c], expf(ld(xr[c]) - m) * inv);
    }
}

// (v, i) beats (bv, bi)? NaN is the largest value; ties go to the lower index (NumPy).
__device__ __forceinline__ bool better(float v, int i, float bv, int bi) {
    const bool vn = v != v, bn = bv != bv;
    if (vn || bn) return vn && (!bn || i < bi);
    return v > bv || (v == bv && i < bi);
}

// The elements of one 16-byte vector, columns c0, c0 + 1, ...
template <typename T>
__device__ __forceinline__ void argmax_vec(const uint4& u, int c0, float& bv, int& bi) {
    const T* e = reinterpret_cast<const T*>(&u);
#pragma unroll
    for (int j = 0; j < 16 / (int)sizeof(T); ++j) {
        const float v = ld(e[j]);
        if (better(v, c0 + j, bv, bi)) { bv = v; bi = c0 + j; }
    }
}

// One thread's share of a row: 16-byte vectors t, t + tpr, ... (four loads in flight) when
// the row is 16-byte aligned, then the columns past the last whole vector one by one.
// The visiting order does not matter: better() breaks ties by index.
template <typename T>
__device__ __forceinline__ void argmax_scan(const T* __restrict__ xr, int cols, int t, int tpr,
                                            float& bv, int& bi) {
    constexpr int V = 16 / sizeof(T);
    int done = 0;
    if ((reinterpret_cast<unsigned long long>(xr) & 15) == 0) {
        const int nv = cols / V;
        const uint4* xv = reinterpret_cast<const uint4*>(xr);
        int c = t;
        for (; c + 3 * tpr < nv; c += 4 * tpr) {
            uint4 u[4];
#pragma unroll
            for (int k = 0; k < 4; ++k) u[k] = __ldg(xv + c + k * tpr);
#pragma unroll
            for (int k = 0; k < 4; ++k) argmax_vec<T>(u[k], (c + k * tpr) * V, bv, bi);
        }
        for (; c < nv; c += tpr) argmax_vec<T>(__ldg(xv + c), c * V, bv, bi);
        done = nv * V;
    }
    for (int c = done + t; c < cols; c += tpr) {
        const float v = ld(xr[c]);
        if (better(v, c, bv, bi)) { bv = v; bi = c; }
    }
}

// out[r] = argmax(x[r, :])   (first index of the maximum, NumPy semantics)
template <typename T, typename I>
__global__ void argmax(I* __restrict__ out, const T* __restrict__ x, long long rows, int cols,
                       int tpr) {
    __shared__ float shv[32];
    __shared__ int shi[32];
    const int rpb = blockDim.x / tpr;
    const int t = threadIdx.x % tpr;
    for (long long base = (long long)blockIdx.x * rpb; base < rows;
         base += (long long)gridDim.x * rpb) {
        const long long r = base + threadIdx.x / tpr;
        if (r >= rows) continue;
        float bv = NEG_INF;
        int bi = 0x7fffffff;
        argmax_scan(x + r * cols, cols, t, tpr, bv, bi);
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (better(ov, oi, bv, bi)) { bv = ov; bi = oi; }
        }
        if (tpr != 32) {
            const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
            __syncthreads();
            if (lane == 0) { shv[w] = bv; shi[w] = bi; }
            __syncthreads();
            bv = lane < nw ? shv[lane] : NEG_INF;
            bi = lane < nw ? shi[lane] : 0x7fffffff;
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) {
                const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
                const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
                if (better(ov, oi, bv, bi)) { bv = ov; bi = oi; }
            }
        }
        if (t == 0) out[r] = (I)bi;
    }
}

// gelu, tanh approximation: 0.5 v (1 + tanh(sqrt(2/pi) (v + 0.044715 v^3)))
template <typename T>
__global__ void gelu(T* out, const T* x, long long n) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const float v = ld(x[i]);
        st(out[i], 0.5f * v * (1.f + tanhf(0.7978845608028654f * (v + 0.044715f * v * v * v))));
    }
}

// silu: v * sigmoid(v)
template <typename T>
__global__ void silu(T* out, const T* x, long long n) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const float v = ld(x[i]);
        st(out[i], v / (1.f + expf(-v)));
    }
}

// out[r, :] = table[clamp(ids[r], 0, vocab - 1), :]: out-of-range ids are clamped (both backends).
// E is the element's bit pattern (16, 32 or 64-bit unsigned): a gather copies, never converts.
template <typename E, typename I>
__global__ void embedding(E* __restrict__ out, const E* __restrict__ table,
                          const I* __restrict__ ids, long long n_ids, long long vocab, int dim) {
    for (long long r = blockIdx.x; r < n_ids; r += gridDim.x) {
        long long id = (long long)ids[r];
        id = id < 0 ? 0 : (id >= vocab ? vocab - 1 : id);  // out-of-range ids are clamped (documented)
        E* orow = out + r * dim;
        const E* trow = table + id * dim;
        for (int c = threadIdx.x; c < dim; c += blockDim.x) orow[c] = trow[c];
    }
}
