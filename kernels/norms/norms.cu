// Norm kernels: layer_norm (row-wise over the last dim, one warp or block a row) and
// add_rms_norm (also plain rms_norm; one block a row). Launchers: kernels/norms/_cuda.py.
// In-place use (out == x) is allowed: every element is read by the thread that writes it,
// after every read of the reductions.
// Storage types for the 16-bit floats are plain structs converted with PTX `cvt` (no
// cuda_fp16.h / cuda_bf16.h needed under NVRTC). Every kernel loads its inputs as float32,
// accumulates in float32 and rounds once on store.

#include "rows.cuh"

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

// ---------------------------------------------------------------------------- add_rms_norm
// (rows, cols) rows, one block per row (blocks stride over rows). With `res` non-null:
// s = round(x + res) is stored to res_out and normalised; with `res` null: s = x.
// out = s * rsqrt(mean(s^2) + eps) * w.
// NV > 0: thread t holds the vectors t, t + blockDim, ..., (NV of them) in registers between
// the reduction and the store: one read, one write (NV * VEC <= 32 floats: the launcher's
// rule, so 1024-thread blocks fit in 64 registers a thread without spilling). NV == 0 (rows too long to hold): the
// second pass re-reads s (from res_out, or x), each element by the thread that wrote it.
// In place (out == x, res_out == res or res_out == x) is safe: each element is read and
// written by one thread, every read before that thread's write.
template <typename T, int VEC, int NV>
__global__ void __launch_bounds__(1024) add_rms_norm(T* out, T* res_out, const T* x, const T* res, const T* __restrict__ w,
                             long long rows, int cols, float eps) {
    __shared__ float sh[32];
    const int nvec = cols / VEC;  // VEC divides cols (launcher)
    for (long long r = blockIdx.x; r < rows; r += gridDim.x) {
        const T* xr = x + r * cols;                             // (cols,)
        const T* rr = res ? res + r * cols : nullptr;
        T* ror = res ? res_out + r * cols : nullptr;
        T* orow = out + r * cols;
        float ss = 0.f;
        if constexpr (NV > 0) {
            float v[NV][VEC];
            float g1[VEC];  // NV == 1 (short rows): the weights load before the reduction
#pragma unroll
            for (int k = 0; k < NV; ++k) {
                const int c = k * blockDim.x + threadIdx.x;
                if (c < nvec) {
                    load_vec<T, VEC>(v[k], xr + c * VEC);
                    if constexpr (NV == 1) load_vec<T, VEC>(g1, w + c * VEC);
                    if (rr) {
                        float b[VEC];
                        load_vec<T, VEC>(b, rr + c * VEC);
#pragma unroll
                        for (int e = 0; e < VEC; ++e) v[k][e] = round_to<T>(v[k][e] + b[e]);
                        store_vec<T, VEC>(ror + c * VEC, v[k]);
                    }
#pragma unroll
                    for (int e = 0; e < VEC; ++e) ss += v[k][e] * v[k][e];
                }
            }
            const float inv = rsqrtf(block_sum(ss, sh) / (float)cols + eps);
#pragma unroll
            for (int k = 0; k < NV; ++k) {
                const int c = k * blockDim.x + threadIdx.x;
                if (c < nvec) {
                    float g[VEC];
                    if constexpr (NV == 1) {
#pragma unroll
                        for (int e = 0; e < VEC; ++e) g[e] = g1[e];
                    } else {
                        load_vec<T, VEC>(g, w + c * VEC);
                    }
#pragma unroll
                    for (int e = 0; e < VEC; ++e) g[e] = v[k][e] * inv * g[e];
                    store_vec<T, VEC>(orow + c * VEC, g);
                }
            }
        } else {
            for (int c = threadIdx.x; c < nvec; c += blockDim.x) {
                float a[VEC];
                load_vec<T, VEC>(a, xr + c * VEC);
                if (rr) {
                    float b[VEC];
                    load_vec<T, VEC>(b, rr + c * VEC);
#pragma unroll
                    for (int e = 0; e < VEC; ++e) a[e] = round_to<T>(a[e] + b[e]);
                    store_vec<T, VEC>(ror + c * VEC, a);
                }
#pragma unroll
                for (int e = 0; e < VEC; ++e) ss += a[e] * a[e];
            }
            const float inv = rsqrtf(block_sum(ss, sh) / (float)cols + eps);
            const T* sr = rr ? (const T*)ror : xr;  // s, as this thread stored it
            for (int c = threadIdx.x; c < nvec; c += blockDim.x) {
                float a[VEC], g[VEC];
                load_vec<T, VEC>(a, sr + c * VEC);
                load_vec<T, VEC>(g, w + c * VEC);
#pragma unroll
                for (int e = 0; e < VEC; ++e) a[e] = a[e] * inv * g[e];
                store_vec<T, VEC>(orow + c * VEC, a);
            }
        }
    }
}
