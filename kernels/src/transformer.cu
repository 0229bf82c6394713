// Transformer kernels: add_rms_norm (also plain rms_norm), rope, rope_kv_write, merge_heads and
// swiglu (launchers: kernels/_norms.py, kernels/_norm_ops.py, _activation_ops.py and _rope_ops.py). sampling.cu (sample) is compiled
// in the same module, appended to this file.
//
// Storage types for the 16-bit floats are plain structs converted with PTX `cvt` (no
// cuda_fp16.h / cuda_bf16.h under NVRTC), as in nn_ops.cu. Math is float32; every output is
// rounded once on store. `VEC` is the number of elements moved per access: 16 bytes
// (uint4) when the launcher found the row length and every pointer 16-byte aligned, else 1.
// No kernel allocates, reads device values on the host or depends on the grid size for its
// result, so all of them can be captured into a CUDA graph.

#include "float16_types.cuh"

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

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
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

// ---------------------------------------------------------------------------- rope
// cos/sin of pos * theta^(-2j/D): the angle in float64 and reduced modulo 2*pi before the
// float32 sincos, so positions in the hundreds of thousands keep float32 accuracy.
__device__ __forceinline__ void rope_angle(long long pos, int j, int d, double log2_theta,
                                           float* c, float* s) {
    const double inv_freq = exp2(-(2.0 * j / d) * log2_theta);
    double a = (double)pos * inv_freq;
    const double two_pi = 6.283185307179586;
    a -= rint(a * (1.0 / two_pi)) * two_pi;
    sincosf((float)a, s, c);
}

// Rotate one VEC-wide slice [j, j + VEC) of a head: src/dst point at the head's start (D,).
template <typename T, int VEC>
__device__ __forceinline__ void rope_slice(T* dst, const T* src, int j, int d, long long pos,
                                           double log2_theta) {
    const int half = d / 2;
    float a[VEC], b[VEC];
    load_vec<T, VEC>(a, src + j);
    load_vec<T, VEC>(b, src + j + half);
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
        float c, s;
        rope_angle(pos, j + e, d, log2_theta, &c, &s);
        const float x1 = a[e], x2 = b[e];
        a[e] = x1 * c - x2 * s;
        b[e] = x2 * c + x1 * s;
    }
    store_vec<T, VEC>(dst + j, a);
    store_vec<T, VEC>(dst + j + half, b);
}

// x, out (B, L, H, D); start (B,): token (b, i) is at position start[b] + i.
// One thread per (b, i, h, VEC-slice of the first half). out may be x.
template <typename T, int VEC>
__global__ void rope(T* out, const T* x, const int* __restrict__ start, long long n_units,
                     int L, int H, int D, double log2_theta) {
    const int jv_n = D / 2 / VEC;
    for (long long u = (long long)blockIdx.x * blockDim.x + threadIdx.x; u < n_units;
         u += (long long)gridDim.x * blockDim.x) {
        const int jv = (int)(u % jv_n);
        const long long th = u / jv_n;        // token * H + h
        const long long tok = th / H;         // b * L + i
        const int i = (int)(tok % L);
        const long long b = tok / L;
        const long long pos = (long long)start[b] + i;
        rope_slice<T, VEC>(out + th * D, x + th * D, jv * VEC, D, pos, log2_theta);
    }
}

// qkv (B, L, (Hq + 2 Hkv) D): q heads, k heads, v heads of each token.
// q_out (B, Hq, L, D) <- rope(q); k_cache/v_cache (B, Hkv, S, D) row start[b] + i <- rope(k), v
// (skipped where that position is outside [0, S)).
// Paged (block_table != nullptr): the caches are a block pool (NB, Hkv, BS, D) with S = BS and
// block_table (B, MB) int32; position p of row b goes to block block_table[b, p / BS], row
// p % BS; skipped where p is outside [0, MB * BS) or the block id outside [0, NB).
// Units per token: (Hq + Hkv) heads x D/2/VEC rotated slices, then Hkv x D/VEC copied slices.
template <typename T, int VEC>
__global__ void rope_kv_write(T* q_out, T* k_cache, T* v_cache, const T* __restrict__ qkv,
                              const int* __restrict__ start, long long n_tok, int L, int Hq,
                              int Hkv, int D, long long S, double log2_theta,
                              const int* __restrict__ block_table, int MB, long long NB) {
    const int jv_n = D / 2 / VEC, dv_n = D / VEC;
    const int n_rot = (Hq + Hkv) * jv_n;
    const int per_tok = n_rot + Hkv * dv_n;
    const long long n_units = n_tok * per_tok;
    const int W = (Hq + 2 * Hkv) * D;
    for (long long u = (long long)blockIdx.x * blockDim.x + threadIdx.x; u < n_units;
         u += (long long)gridDim.x * blockDim.x) {
        const long long tok = u / per_tok;    // b * L + i
        const int k = (int)(u - tok * per_tok);
        const int i = (int)(tok % L);
        const long long b = tok / L;
        const long long pos = (long long)start[b] + i;
        const T* row = qkv + tok * W;         // (Hq + 2 Hkv, D)
        // cache coordinates of this token: (cache row cb, position cp), or none (cb < 0)
        long long cb = b, cp = pos;
        if (pos < 0 || pos >= (block_table ? (long long)MB * S : S)) {
            cb = -1;
        } else if (block_table) {
            cb = block_table[b * MB + pos / S];
            cp = pos % S;
            if (cb >= NB) cb = -1;
        }
        if (k < n_rot) {
            const int h = k / jv_n, jv = k - h * jv_n;
            T* dst;
            if (h < Hq) {
                dst = q_out + ((b * Hq + h) * L + i) * D;
            } else {
                if (cb < 0) continue;
                dst = k_cache + ((cb * Hkv + (h - Hq)) * S + cp) * D;
            }
            rope_slice<T, VEC>(dst, row + h * D, jv * VEC, D, pos, log2_theta);
        } else {
            if (cb < 0) continue;
            const int kk = k - n_rot, h = kk / dv_n, dv = kk - h * dv_n;
            const T* src = row + (Hq + Hkv + h) * D + dv * VEC;
            T* dst = v_cache + ((cb * Hkv + h) * S + cp) * D + dv * VEC;
            if constexpr (sizeof(T) * VEC == 16) {
                *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
            } else {
#pragma unroll
                for (int e = 0; e < VEC; ++e) dst[e] = src[e];
            }
        }
    }
}

// ---------------------------------------------------------------------------- merge_heads
// x (B, H, L, DV) -> out (B, L, H, DV), E = the bits of one moved unit (2 to 16 bytes).
template <typename E>
__global__ void merge_heads(E* __restrict__ out, const E* __restrict__ x, long long n_units,
                            int H, int L, int DV) {
    for (long long u = (long long)blockIdx.x * blockDim.x + threadIdx.x; u < n_units;
         u += (long long)gridDim.x * blockDim.x) {
        const int dv = (int)(u % DV);
        const long long t = u / DV;           // (b * L + l) * H + h
        const int h = (int)(t % H);
        const long long bl = t / H;
        const int l = (int)(bl % L);
        const long long b = bl / L;
        out[u] = x[((b * H + h) * L + l) * DV + dv];
    }
}

// ---------------------------------------------------------------------------- swiglu
// gate_up (rows, 2F) -> out (rows, F): silu(gate) * up, one thread per VEC outputs.
template <typename T, int VEC>
__global__ void swiglu(T* out, const T* gate_up, long long rows, int F) {
    const int fv = F / VEC;
    const long long n_units = rows * fv;
    for (long long u = (long long)blockIdx.x * blockDim.x + threadIdx.x; u < n_units;
         u += (long long)gridDim.x * blockDim.x) {
        const long long r = u / fv;
        const int c = (int)(u - r * fv) * VEC;
        const T* g = gate_up + r * 2 * F + c;
        float a[VEC], b[VEC];
        load_vec<T, VEC>(a, g);
        load_vec<T, VEC>(b, g + F);
#pragma unroll
        for (int e = 0; e < VEC; ++e) a[e] = a[e] / (1.f + expf(-a[e])) * b[e];
        store_vec<T, VEC>(out + r * F + c, a);
    }
}
