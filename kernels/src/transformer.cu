// Transformer kernels: add_rms_norm (also plain rms_norm), rope, rope_kv_write, merge_heads,
// swiglu and sample. Launchers: kernels/_norms.py, kernels/_transformer.py, kernels/_sampling.py.
//
// Storage types for the 16-bit floats are plain structs converted with PTX `cvt` (no
// cuda_fp16.h / cuda_bf16.h under NVRTC), as in nn_ops.cu. Math is float32; every output is
// rounded once on store. `VEC` is the number of elements moved per access: 16 bytes
// (uint4) when the launcher found the row length and every pointer 16-byte aligned, else 1.
// No kernel allocates, reads device values on the host or depends on the grid size for its
// result, so all of them can be captured into a CUDA graph.

struct f16 { unsigned short x; };
struct bf16 { unsigned short x; };

__device__ __forceinline__ float ld(float v) { return v; }
__device__ __forceinline__ float ld(f16 v) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v.x));
    return f;
}
__device__ __forceinline__ float ld(bf16 v) { return __uint_as_float(((unsigned)v.x) << 16); }

__device__ __forceinline__ void st(float& d, float v) { d = v; }
__device__ __forceinline__ void st(f16& d, float v) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v));
    d.x = h;
}
__device__ __forceinline__ void st(bf16& d, float v) {
    unsigned short h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(v));
    d.x = h;
}

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
// Units per token: (Hq + Hkv) heads x D/2/VEC rotated slices, then Hkv x D/VEC copied slices.
template <typename T, int VEC>
__global__ void rope_kv_write(T* q_out, T* k_cache, T* v_cache, const T* __restrict__ qkv,
                              const int* __restrict__ start, long long n_tok, int L, int Hq,
                              int Hkv, int D, long long S, double log2_theta) {
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
        if (k < n_rot) {
            const int h = k / jv_n, jv = k - h * jv_n;
            T* dst;
            if (h < Hq) {
                dst = q_out + ((b * Hq + h) * L + i) * D;
            } else {
                if (pos < 0 || pos >= S) continue;
                dst = k_cache + ((b * Hkv + (h - Hq)) * S + pos) * D;
            }
            rope_slice<T, VEC>(dst, row + h * D, jv * VEC, D, pos, log2_theta);
        } else {
            if (pos < 0 || pos >= S) continue;
            const int kk = k - n_rot, h = kk / dv_n, dv = kk - h * dv_n;
            const T* src = row + (Hq + Hkv + h) * D + dv * VEC;
            T* dst = v_cache + ((b * Hkv + h) * S + pos) * D + dv * VEC;
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

// ---------------------------------------------------------------------------- sample
// One block per row of logits (B, V). Row b:
//   u = uniform(seed[b], counter[b]); counter[b] += 1 (every row, greedy ones too);
//   temperature <= 0 (or a row whose max is not finite): out = argmax (first max; NaN wins);
//   else w_i = exp((x_i - max) / temperature) over the kept set, which is
//     top-k: x_i >= the k-th largest value (ties at the threshold kept, as HF's warper), then
//     top-p: x_i >= the largest value t whose kept mass {x >= t} reaches top_p * sum(w);
//   out = the first index i (in index order) where the running sum of kept w exceeds u * sum.
// Thresholds are found without a sort: a radix select on an order-preserving 32-bit key of
// the value, four 8-bit digits, a shared-memory histogram (counts for top-k, weights for
// top-p) per digit. The draw: thread t owns a contiguous chunk of the row; a block scan of
// the chunk sums finds the chunk holding u * sum; that thread walks it.

// The same hash as kernels/_sampling.py (splitmix64's finalizer, twice).
__device__ __forceinline__ unsigned long long mix64(unsigned long long z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

__device__ __forceinline__ float uniform01(long long seed, long long counter) {
    const unsigned long long g = 0x9E3779B97F4A7C15ull;
    const unsigned long long z =
        mix64(mix64((unsigned long long)seed) + ((unsigned long long)counter + 1ull) * g);
    return (float)(z >> 40) * (1.f / 16777216.f);  // 24 bits: exact in float32 and float64
}

// Larger float -> larger key (-0 counted as +0; NaN unsupported).
__device__ __forceinline__ unsigned fkey(float f) {
    const unsigned u = __float_as_uint(f + 0.f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// (v, i) beats (bv, bi)? NaN is the largest value; ties go to the lower index (NumPy).
__device__ __forceinline__ bool better(float v, int i, float bv, int bi) {
    const bool vn = v != v, bn = bv != bv;
    if (vn || bn) return vn && (!bn || i < bi);
    return v > bv || (v == bv && i < bi);
}

// Warp 0 picks, scanning 256 bins from the top, the first bin where the running total
// (`above` + bins >= d) reaches `need`; writes the bin to *s_bin (-1: none) and the total of
// the bins strictly above it to *s_above. H is unsigned (counts) or float (weights).
template <typename H>
__device__ __forceinline__ void pick_bin(const H* hist, H above, H need, int* s_bin, H* s_above) {
    if (threadIdx.x >= 32) return;
    const int lane = threadIdx.x;
    H h[8], lane_sum = 0;
#pragma unroll
    for (int q = 0; q < 8; ++q) {  // lane 0 owns bins 255..248, lane 31 owns 7..0
        h[q] = hist[255 - 8 * lane - q];
        lane_sum += h[q];
    }
    H incl = lane_sum;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const H t = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += t;
    }
    const H before = __shfl_up_sync(0xffffffffu, incl, 1);
    const H excl = above + (lane ? before : (H)0);
    const unsigned hit = __ballot_sync(0xffffffffu, excl + lane_sum >= need && lane_sum > (H)0);
    if (hit == 0u) {
        if (lane == 0) *s_bin = -1;
        return;
    }
    if (lane == __ffs(hit) - 1) {
        H run = excl;
        int q = 0;
        for (; q < 7; ++q) {
            if (h[q] > (H)0 && run + h[q] >= need) break;
            run += h[q];
        }
        *s_bin = 255 - 8 * lane - q;
        *s_above = run;
    }
}

template <typename T>
__global__ void __launch_bounds__(1024) sample(int* __restrict__ out, long long* __restrict__ counter,
                       const T* __restrict__ logits, const float* __restrict__ temperature,
                       const int* __restrict__ top_k, const float* __restrict__ top_p,
                       const long long* __restrict__ seed, int V) {
    __shared__ unsigned hist_u[256];
    __shared__ float hist_f[256];
    __shared__ float shf[32];
    __shared__ int shi[32];
    __shared__ int s_bin;
    __shared__ unsigned s_above_u;
    __shared__ float s_above_f;
    const int b = blockIdx.x, tid = threadIdx.x, lane = tid & 31, wid = tid >> 5;
    const int nw = (blockDim.x + 31) >> 5;
    const T* x = logits + (long long)b * V;  // (V,)
    const float temp = temperature[b];
    const int k = top_k[b];
    const float p = top_p[b];
    const long long ctr = counter[b];
    const float u = uniform01(seed[b], ctr);

    // max and first argmax
    float bv = __int_as_float(0xff800000);
    int bi = 0x7fffffff;
    for (int i = tid; i < V; i += blockDim.x) {
        const float v = ld(x[i]);
        if (better(v, i, bv, bi)) { bv = v; bi = i; }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
        const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        if (better(ov, oi, bv, bi)) { bv = ov; bi = oi; }
    }
    if (lane == 0) { shf[wid] = bv; shi[wid] = bi; }
    __syncthreads();
    bv = lane < nw ? shf[lane] : __int_as_float(0xff800000);
    bi = lane < nw ? shi[lane] : 0x7fffffff;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
        const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        if (better(ov, oi, bv, bi)) { bv = ov; bi = oi; }
    }
    if (tid == 0) counter[b] = ctr + 1;  // every thread read counter[b] above this barrier
    const float m = bv;
    if (!(temp > 0.f) || !isfinite(m) || !isfinite(1.f / temp)) {  // (a denormal temperature)
        if (tid == 0) out[b] = bi;
        return;
    }

    // top-k: key of the k-th largest value (radix select on counts)
    unsigned thr = 0u;
    if (k > 0 && k < V) {
        unsigned prefix = 0u, mask = 0u, rank = (unsigned)k;
        for (int shift = 24; shift >= 0; shift -= 8) {
            for (int q = tid; q < 256; q += blockDim.x) hist_u[q] = 0u;
            __syncthreads();
            for (int i = tid; i < V; i += blockDim.x) {
                const unsigned key = fkey(ld(x[i]));
                if ((key & mask) == prefix) atomicAdd(&hist_u[(key >> shift) & 255u], 1u);
            }
            __syncthreads();
            pick_bin<unsigned>(hist_u, 0u, rank, &s_bin, &s_above_u);
            __syncthreads();
            rank -= s_above_u;  // s_bin >= 0: rank <= the count of keys under the prefix
            prefix |= (unsigned)s_bin << shift;
            mask |= 255u << shift;
            __syncthreads();  // s_bin / s_above_u are rewritten next digit
        }
        thr = prefix;
    }
    const float inv_t = 1.f / temp;

    // top-p: the largest key whose kept mass {key >= it} reaches top_p * Z (radix on weights)
    if (p < 1.f) {
        float z = 0.f;
        for (int i = tid; i < V; i += blockDim.x) {
            const float v = ld(x[i]);
            if (fkey(v) >= thr) z += expf((v - m) * inv_t);
        }
        z = block_sum(z, shf);
        const float need = fmaxf(p * z, 1.17549435e-38f);
        unsigned prefix = 0u, mask = 0u;
        float above = 0.f;
        bool found = true;
        for (int shift = 24; shift >= 0; shift -= 8) {
            for (int q = tid; q < 256; q += blockDim.x) hist_f[q] = 0.f;
            __syncthreads();
            for (int i = tid; i < V; i += blockDim.x) {
                const float v = ld(x[i]);
                const unsigned key = fkey(v);
                if (key >= thr && (key & mask) == prefix)
                    atomicAdd(&hist_f[(key >> shift) & 255u], expf((v - m) * inv_t));
            }
            __syncthreads();
            pick_bin<float>(hist_f, above, need, &s_bin, &s_above_f);
            __syncthreads();
            const int bin = s_bin;
            if (bin < 0) { found = false; break; }  // rounding: the whole set is kept
            above = s_above_f;
            prefix |= (unsigned)bin << shift;
            mask |= 255u << shift;
            __syncthreads();
        }
        if (found && prefix > thr) thr = prefix;
    }

    // inverse-CDF draw in index order over the kept set
    const int seg = (V + blockDim.x - 1) / blockDim.x;
    const int lo = min(tid * seg, V), hi = min(lo + seg, V);
    float s = 0.f;
    for (int i = lo; i < hi; ++i) {
        const float v = ld(x[i]);
        if (fkey(v) >= thr) s += expf((v - m) * inv_t);
    }
    float incl = s;  // block inclusive scan of the chunk sums
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const float t = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += t;
    }
    const float prev = __shfl_up_sync(0xffffffffu, incl, 1);
    __syncthreads();
    if (lane == 31) shf[wid] = incl;
    __syncthreads();
    if (tid == 0) {
        float run = 0.f;
        for (int q = 0; q < nw; ++q) {
            const float t = shf[q];
            shf[q] = run;
            run += t;
        }
        s_above_f = run;  // Z
    }
    __syncthreads();
    const float off = shf[wid];
    const float lo_sum = lane ? prev + off : off;  // == the previous thread's hi_sum
    const float hi_sum = incl + off;
    const float target = u * s_above_f;
    if (s > 0.f && lo_sum <= target && target < hi_sum) {
        float run = lo_sum;
        int pick = -1, last = -1;
        for (int i = lo; i < hi; ++i) {
            const float v = ld(x[i]);
            if (fkey(v) < thr) continue;
            const float wv = expf((v - m) * inv_t);
            if (wv <= 0.f) continue;
            last = i;
            run += wv;
            if (run > target) { pick = i; break; }
        }
        out[b] = pick >= 0 ? pick : last;
    }
}
