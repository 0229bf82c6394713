// Transformer kernels: rope, rope_kv_write, merge_heads and split_qkv (launchers:
// kernels/transformer/_cuda.py). `VEC` is the number of elements moved per access: 16 bytes
// (uint4) when the launcher found the row length and every pointer 16-byte aligned, else 1.
// No kernel allocates, reads device values on the host or depends on the grid size for its
// result, so all of them can be captured into a CUDA graph.
// Storage types for the 16-bit floats are plain structs converted with PTX `cvt` (no
// cuda_fp16.h / cuda_bf16.h needed under NVRTC). Every kernel loads its inputs as float32,
// accumulates in float32 and rounds once on store.

#include "rows.cuh"

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

// ---------------------------------------------------------------------------- split_qkv
// qkv (B, L, HT, DV) with HT = Hq + 2 Hkv heads (q heads, then k, then v) -> q (B, Hq, L, DV),
// k and v (B, Hkv, L, DV); E = the bits of one moved unit (2 to 16 bytes). One thread per
// input unit: the reads are coalesced, each head row is written as DV consecutive units.
template <typename E>
__global__ void split_qkv(E* __restrict__ q, E* __restrict__ k, E* __restrict__ v,
                          const E* __restrict__ x, long long n_units, int Hq, int Hkv, int L,
                          int DV) {
    const int HT = Hq + 2 * Hkv;
    for (long long u = (long long)blockIdx.x * blockDim.x + threadIdx.x; u < n_units;
         u += (long long)gridDim.x * blockDim.x) {
        const int dv = (int)(u % DV);
        const long long t = u / DV;           // (b * L + l) * HT + h
        const int h = (int)(t % HT);
        const long long bl = t / HT;
        const int l = (int)(bl % L);
        const long long b = bl / L;
        if (h < Hq) {
            q[((b * Hq + h) * L + l) * DV + dv] = x[u];
        } else if (h < Hq + Hkv) {
            k[((b * Hkv + (h - Hq)) * L + l) * DV + dv] = x[u];
        } else {
            v[((b * Hkv + (h - Hq - Hkv)) * L + l) * DV + dv] = x[u];
        }
    }
}

// ---------------------------------------------------------------------------- qk_rms_norm
// In place on the fused QKV rows x (n_tok, (Hq + 2 Hkv) D): every q head (0 .. Hq-1) and k
// head (Hq .. Hq+Hkv-1) of D elements is RMS-normed, x / sqrt(mean(x^2) + eps) * w, with wq
// for q heads and wk for k heads; v heads are left alone. One warp per (token, head): each
// lane reads its elements, the warp sums the squares, the lane writes the same elements
// (in place is safe: no element is read by one lane and written by another).
template <typename T>
__global__ void qk_rms_norm(T* x, const T* __restrict__ wq, const T* __restrict__ wk,
                            long long n_tok, int Hq, int Hkv, int D, float eps) {
    const int lane = threadIdx.x & 31;
    const long long warps = (long long)gridDim.x * (blockDim.x >> 5);
    const int nh = Hq + Hkv;
    const long long n_units = n_tok * nh;
    for (long long u = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); u < n_units;
         u += warps) {
        const long long tok = u / nh;
        const int h = (int)(u - tok * nh);
        T* row = x + tok * (long long)(Hq + 2 * Hkv) * D + (long long)h * D;
        const T* w = h < Hq ? wq : wk;
        float ss = 0.f;
        for (int c = lane; c < D; c += 32) {
            const float v = ld(row[c]);
            ss = fmaf(v, v, ss);
        }
        ss = warp_sum(ss);
        const float inv = rsqrtf(ss / (float)D + eps);
        for (int c = lane; c < D; c += 32) st(row[c], ld(row[c]) * inv * ld(w[c]));
    }
}
