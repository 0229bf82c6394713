// fused_decode: one persistent kernel for a whole decode step of a Llama-family model
// (launcher: kernels/fused/op.py; weight packing: kernels/fused/_plan.py).
//
// One cooperative grid (one 256-thread block per SM) walks every layer through five phases
// separated by grid-wide barriers (global-memory counters):
//
//   A  s = round(resid + round(sum of the down partials + bias)) (layer 0: the token
//      embedding), normed = rms_norm(s) * w1 into shared memory; QKV projection; RoPE on q
//      and k; q to `q`, k and v into the paged cache at the row's position
//   B  attention of each row's query over its kv_len cached keys, split over key ranges of
//      32.. positions; the last split to finish a (row, kv head) combines them into `att`
//   C  O projection of `att`, split over K into `ks_o` float32 partials
//   D  s = round(resid + round(sum of the O partials + bias)), normed = rms_norm(s) * w2;
//      gate/up projection and SwiGLU into `act`
//   E  down projection of `act`, split over K into `ks_d` float32 partials
//
// then the final norm and the LM head into `logits`. Every projection is tensor-core
// `mma.m16n8k16` with the weights as the A operand, pre-packed (_plan.py) so that one k-step of
// a 16-row strip is 32 lanes x 16 bytes, the A fragments in register order: one coalesced
// 16-byte load per lane and k-step. The rows (B <= 8 * NT) are the N operand, read from
// shared memory. QKV strips pair each head's dims j and j + D/2 (rows g and g + 8 of the
// fragment), so RoPE runs on the accumulators; gate/up strips pair gate row j with up row j.
// Rounding follows the unfused path (every projection rounded to T before it is used, the
// residual stored in T), so both agree up to float32 summation order.
//
// Before each barrier a block asks L2 to prefetch the weights it reads in the next phase
// (`cp.async.bulk.prefetch.L2`), so a phase starts on weights already on chip.
// Data written in this launch by other blocks is read with `ld.global.cg` (L2, never a stale
// L1 line); weights with the non-coherent path.

#include "rows.cuh"
#include "ptx_common.cuh"

#define FD_WARPS 8
#define FD_THREADS 256
#define FD_GMAX 8          // query heads per kv head
#define FD_MAX_SPLITS 64   // key splits per (row, kv head)

struct FdLayer {
    const uint4* wqkv; const uint4* wo; const uint4* wgu; const uint4* wd;
    const void* bqkv; const void* bo; const void* bgu; const void* bd;
    const void* n1; const void* n2; void* kc; void* vc;
};

// Every field 8 bytes (op.py builds the same record with NumPy).
struct FdParams {
    const FdLayer* layers; long long n_layers;
    const void* embed; const uint4* w_head; const void* norm_f;
    const int* state; long long stride;
    const int* table; long long mb; long long nb; long long bs;
    void* logits; void* r0; void* r1; void* q; void* att; void* act;
    float* part; float* attp; unsigned* bar; unsigned* done;
    long long B, H, Hq, Hkv, F, V, KP;
    double eps, log2_theta, scale_log2;
    long long ks_o, ks_d, wps_qkv, wps_o, wps_gu, wps_d, wps_head;
    unsigned long long* ticks;  // profiling (null: off): block 0's clock after every barrier
    long long detail;           // profiling: ticks inside phase C from ticks[5 * layers + 3]
    long long variant;          // timing experiments only (FD_SKIP_*): parts left out or doubled
};

// Timing variants (FdParams::variant; 0 in use): leave a part of every phase out, or run each
// barrier twice, so differences of step times place the time (the results are then wrong).
#define FD_SKIP_ATTN 1
#define FD_SKIP_GEMV 2
#define FD_SKIP_NORM 4
#define FD_SKIP_TILE 8
#define FD_SKIP_PREFETCH 16  // the L2 prefetches (the register preloads stay)
#define FD_DOUBLE_BAR 32

// ------------------------------------------------------------------ memory helpers
// Weights: read-only for the launch. `volatile`, so the compiler issues a load where it is
// written (a fragment loaded before a barrier must not be sunk to its use after it).
__device__ __forceinline__ uint4 ld_w(const uint4* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}
// (the __ldcg builtins: the compiler knows they read global memory, so it keeps them after
// the barriers' __syncthreads and still batches them ahead of shared-memory stores)
__device__ __forceinline__ uint4 ld_cg16(const void* p) { return __ldcg((const uint4*)p); }
__device__ __forceinline__ float4 ld_cg4f(const float* p) { return __ldcg((const float4*)p); }
__device__ __forceinline__ float ld_cgf(const float* p) { return __ldcg(p); }
__device__ __forceinline__ u32 ld_cg32(const void* p) { return __ldcg((const unsigned*)p); }
__device__ __forceinline__ u32 ld_acquire(const unsigned* p) {
    u32 v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void prefetch_l2(const void* p, u32 bytes) {
#if __CUDA_ARCH__ >= 900
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
#endif
}

// 16-bit pairs <-> floats
template <typename T> __device__ __forceinline__ float lo_f(u32 v);
template <typename T> __device__ __forceinline__ float hi_f(u32 v);
template <> __device__ __forceinline__ float lo_f<f16>(u32 v) { f16 h; h.x = (unsigned short)(v & 0xffff); return ld(h); }
template <> __device__ __forceinline__ float hi_f<f16>(u32 v) { f16 h; h.x = (unsigned short)(v >> 16); return ld(h); }
template <> __device__ __forceinline__ float lo_f<bf16>(u32 v) { return __uint_as_float(v << 16); }
template <> __device__ __forceinline__ float hi_f<bf16>(u32 v) { return __uint_as_float(v & 0xffff0000u); }

template <typename T>
__device__ __forceinline__ void unpack8(float (&f)[8], uint4 v) {
    f[0] = lo_f<T>(v.x); f[1] = hi_f<T>(v.x); f[2] = lo_f<T>(v.y); f[3] = hi_f<T>(v.y);
    f[4] = lo_f<T>(v.z); f[5] = hi_f<T>(v.z); f[6] = lo_f<T>(v.w); f[7] = hi_f<T>(v.w);
}
template <typename T>
__device__ __forceinline__ uint4 pack8(const float (&f)[8]) {
    T h[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) st(h[e], f[e]);
    uint4 v;
    v.x = (u32)h[0].x | ((u32)h[1].x << 16); v.y = (u32)h[2].x | ((u32)h[3].x << 16);
    v.z = (u32)h[4].x | ((u32)h[5].x << 16); v.w = (u32)h[6].x | ((u32)h[7].x << 16);
    return v;
}
template <typename T>
__device__ __forceinline__ float ldT(const void* p, long long i) { return ld(((const T*)p)[i]); }
template <typename T>
__device__ __forceinline__ void stT(void* p, long long i, float v) { st(((T*)p)[i], v); }

// ------------------------------------------------------------------ mma
template <typename T>
__device__ __forceinline__ void mma16816(float (&c)[4], const uint4& a, u32 b0, u32 b1);
template <>
__device__ __forceinline__ void mma16816<f16>(float (&c)[4], const uint4& a, u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, "
                 "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a.x), "r"(a.y), "r"(a.z), "r"(a.w), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void mma16816<bf16>(float (&c)[4], const uint4& a, u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, "
                 "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a.x), "r"(a.y), "r"(a.z), "r"(a.w), "r"(b0), "r"(b1));
}

// ------------------------------------------------------------------ grid barrier
__device__ __forceinline__ void tick_at(const FdParams& p, long long k) {
    if (p.ticks != nullptr && blockIdx.x == 0 && threadIdx.x == 0) {
        unsigned long long t;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
        p.ticks[k] = t;
    }
}
__device__ __forceinline__ void tick(const FdParams& p, int& k) {
    if (p.ticks != nullptr && blockIdx.x == 0 && threadIdx.x == 0) {
        unsigned long long t;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
        p.ticks[k] = t;
    }
    ++k;
}

// One word: each block adds 1 (block 0 adds 2^31 - (grid - 1)), so the top bit flips once
// every block has arrived and the low bits come back to where they were: the barrier
// resets itself, one atomic per block (as cooperative groups' grid sync).
__device__ __forceinline__ void grid_sync(unsigned* bar) {
    __syncthreads();
    if (threadIdx.x == 0) {
        const u32 add = blockIdx.x == 0 ? 0x80000000u - (gridDim.x - 1) : 1u;
        __threadfence();
        const u32 old = atomicAdd(bar, add);
        while (((old ^ ld_acquire(bar)) & 0x80000000u) == 0u) {
        }
    }
    __syncthreads();
}

// Split in two: a block arrives, issues the next phase's weight loads (they do not wait on
// anything), then waits; thread 0's fence is behind only the phase's own stores.
__device__ __forceinline__ u32 bar_arrive(unsigned* bar) {
    __syncthreads();
    u32 old = 0;
    if (threadIdx.x == 0) {
        const u32 add = blockIdx.x == 0 ? 0x80000000u - (gridDim.x - 1) : 1u;
        __threadfence();
        old = atomicAdd(bar, add);
    }
    return old;
}
__device__ __forceinline__ void bar_wait(unsigned* bar, u32 old) {
    if (threadIdx.x == 0) {
        while (((old ^ ld_acquire(bar)) & 0x80000000u) == 0u) {
        }
    }
    __syncthreads();
}

// ------------------------------------------------------------------ GEMV phases
// Items: n_strips x ks (a strip's K split in ks global parts, each written as its own
// partial by the epilogue); a group of `wps` warps computes one item, each warp a slice
// of its k-steps, summed through shared memory. Blocks stride over the items.
// A warp's first fragments of a phase, loaded before the phase's inputs are ready (before
// the barrier that opens it): weights do not depend on activations.
struct Pre {
    uint4 a[8];
};

__device__ __forceinline__ void load_frags(uint4 (&a)[8], const uint4* __restrict__ w, int k0, int k1,
                                           int lane) {
#pragma unroll
    for (int u = 0; u < 8; ++u)
        if (k0 + u < k1) a[u] = ld_w(w + (long long)(k0 + u) * 32 + lane);
}

// The k-step range [k0, k1) warp `sub` of an item's group computes.
__device__ __forceinline__ void item_range(int it, int n_strips, int ksteps, int ks, int wps, int sub,
                                           int& s, int& k0, int& k1) {
    s = it % n_strips;
    const int kp = it / n_strips;
    const int a = kp * ksteps / ks, n = (kp + 1) * ksteps / ks - a;
    k0 = a + sub * n / wps;
    k1 = a + (sub + 1) * n / wps;
}

__device__ __forceinline__ void preload(Pre& pre, const uint4* __restrict__ w, int n_strips, int ksteps,
                                        int ks, int wps) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int it = blockIdx.x * (FD_WARPS / wps) + warp / wps;
    if (w == nullptr || it >= n_strips * ks) return;
    int s, k0, k1;
    item_range(it, n_strips, ksteps, ks, wps, warp % wps, s, k0, k1);
    load_frags(pre.a, w + (long long)s * ksteps * 32, k0, k1, lane);
}

template <typename T, int NT>
__device__ __forceinline__ void strip_dot(float (&acc)[NT][4], const uint4* __restrict__ w,
                                          const T* tile, int KP, int k0, int k1, int lane,
                                          const Pre* pre) {
#pragma unroll
    for (int t = 0; t < NT; ++t)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[t][i] = 0.f;
    const int g = lane >> 2, c = lane & 3;
    const T* bb = tile + g * KP + 2 * c;
    for (int ks = k0; ks < k1; ks += 8) {
        uint4 a[8];
        if (pre != nullptr && ks == k0) {
#pragma unroll
            for (int u = 0; u < 8; ++u) a[u] = pre->a[u];
        } else {
            load_frags(a, w, ks, k1, lane);
        }
#pragma unroll
        for (int u = 0; u < 8; ++u) {
            if (ks + u < k1) {
                const int kk = (ks + u) * 16;
#pragma unroll
                for (int t = 0; t < NT; ++t) {
                    const T* bp = bb + t * 8 * KP + kk;
                    mma16816<T>(acc[t], a[u], *(const u32*)bp, *(const u32*)(bp + 8));
                }
            }
        }
    }
}

// The item range one block covers in a phase, for the L2 prefetch of the next phase.
__device__ __forceinline__ void prefetch_items(const uint4* w, int n_strips, int ksteps, int ks,
                                               int wps, int max_items) {
    if (threadIdx.x != 0 || w == nullptr) return;
    const int groups = FD_WARPS / wps;
    const int items = n_strips * ks;
    int done = 0;
    for (int base = blockIdx.x * groups; base < items && done < max_items;
         base += gridDim.x * groups) {
        for (int gi = 0; gi < groups && base + gi < items && done < max_items; ++gi, ++done) {
            const int it = base + gi, s = it % n_strips, kp = it / n_strips;
            const int k0 = kp * ksteps / ks, k1 = (kp + 1) * ksteps / ks;
            prefetch_l2(w + ((long long)s * ksteps + k0) * 32, (u32)((k1 - k0) * 512));
        }
    }
}

template <typename T, int NT, typename Epi>
__device__ __forceinline__ void gemv_phase(const Pre& pre, const uint4* __restrict__ w, int n_strips,
                                           int ksteps, int ks, int wps, const T* tile, int KP,
                                           float* red, const Epi& epi) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int groups = FD_WARPS / wps, grp = warp / wps, sub = warp % wps;
    const int items = n_strips * ks;
    for (int base = blockIdx.x * groups; base < items; base += gridDim.x * groups) {
        const int it = base + grp;
        float acc[NT][4];
        const bool live = it < items;
        const int s = live ? it % n_strips : 0, kp = live ? it / n_strips : 0;
        if (live) {
            int s2, k0, k1;
            item_range(it, n_strips, ksteps, ks, wps, sub, s2, k0, k1);
            strip_dot<T, NT>(acc, w + (long long)s * ksteps * 32, tile, KP, k0, k1, lane,
                             base == (int)blockIdx.x * groups ? &pre : nullptr);
        }
        if (wps > 1) {
            if (live) {
#pragma unroll
                for (int t = 0; t < NT; ++t)
#pragma unroll
                    for (int i = 0; i < 4; ++i) red[((warp * NT + t) * 4 + i) * 32 + lane] = acc[t][i];
            }
            __syncthreads();
            if (live && sub == 0) {
#pragma unroll
                for (int t = 0; t < NT; ++t)
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        float v = 0.f;
                        for (int x = 0; x < wps; ++x) v += red[(((warp + x) * NT + t) * 4 + i) * 32 + lane];
                        acc[t][i] = v;
                    }
                epi(s, kp, acc, lane);
            }
            __syncthreads();
        } else if (live) {
            epi(s, kp, acc, lane);
        }
    }
}

// ------------------------------------------------------------------ epilogues
__device__ __forceinline__ void rope_angle_f(long long pos, int j, int d, double log2_theta,
                                             float* c, float* s) {
    const double inv_freq = exp2(-(2.0 * j / d) * log2_theta);
    double a = (double)pos * inv_freq;
    const double two_pi = 6.283185307179586;
    a -= rint(a * (1.0 / two_pi)) * two_pi;
    sincosf((float)a, s, c);
}

template <typename T, int NT, int HD>
struct QkvEpi {
    const FdParams* p; const FdLayer* ly; int B;
    __device__ __forceinline__ void operator()(int s, int, float (&acc)[NT][4], int lane) const {
        const int parts = HD / 16, h = s / parts, j = (s % parts) * 8 + (lane >> 2);
        const int c = lane & 3, Hq = (int)p->Hq, Hkv = (int)p->Hkv;
        const void* bias = ly->bqkv;
        float b1 = 0.f, b2 = 0.f;
        if (bias) { b1 = ldT<T>(bias, h * HD + j); b2 = ldT<T>(bias, h * HD + j + HD / 2); }
        float cs = 1.f, sn = 0.f;
        long long pos_prev = -1;
#pragma unroll
        for (int t = 0; t < NT; ++t)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int b = t * 8 + 2 * c + e;
                if (b >= B) continue;
                float x1 = round_to<T>(acc[t][e] + b1), x2 = round_to<T>(acc[t][2 + e] + b2);
                const long long pos = p->state[b];
                if (h < Hq + Hkv) {  // q or k: rotate
                    if (pos != pos_prev) { rope_angle_f(pos, j, HD, p->log2_theta, &cs, &sn); pos_prev = pos; }
                    const float y1 = x1 * cs - x2 * sn, y2 = x2 * cs + x1 * sn;
                    x1 = y1; x2 = y2;
                }
                if (h < Hq) {
                    const long long o = (long long)b * Hq * HD + h * HD + j;
                    stT<T>(p->q, o, x1);
                    stT<T>(p->q, o + HD / 2, x2);
                } else {
                    const int kh = h < Hq + Hkv ? h - Hq : h - Hq - Hkv;
                    if (pos < 0 || pos >= p->mb * p->bs) continue;
                    const long long blk = p->table[(long long)b * p->mb + pos / p->bs];
                    if (blk < 0 || blk >= p->nb) continue;
                    void* cache = h < Hq + Hkv ? ly->kc : ly->vc;
                    const long long o = ((blk * Hkv + kh) * p->bs + pos % p->bs) * HD + j;
                    stT<T>(cache, o, x1);
                    stT<T>(cache, o + HD / 2, x2);
                }
            }
    }
};

template <int NT>
struct PartEpi {  // float32 partials part[kp][b][row] (row stride n)
    float* part; int B; int n;
    __device__ __forceinline__ void operator()(int s, int kp, float (&acc)[NT][4], int lane) const {
        const int r = s * 16 + (lane >> 2), c = lane & 3;
#pragma unroll
        for (int t = 0; t < NT; ++t)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int b = t * 8 + 2 * c + e;
                if (b >= B) continue;
                float* row = part + ((long long)kp * B + b) * n;
                row[r] = acc[t][e];
                row[r + 8] = acc[t][2 + e];
            }
    }
};

template <typename T, int NT>
struct SwigluEpi {
    void* act; const void* bias; int B; int F;
    __device__ __forceinline__ void operator()(int s, int, float (&acc)[NT][4], int lane) const {
        const int j = s * 8 + (lane >> 2), c = lane & 3;
        float bg = 0.f, bu = 0.f;
        if (bias) { bg = ldT<T>(bias, j); bu = ldT<T>(bias, F + j); }
#pragma unroll
        for (int t = 0; t < NT; ++t)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int b = t * 8 + 2 * c + e;
                if (b >= B) continue;
                const float gt = round_to<T>(acc[t][e] + bg), up = round_to<T>(acc[t][2 + e] + bu);
                stT<T>(act, (long long)b * F + j, gt / (1.f + expf(-gt)) * up);
            }
    }
};

template <typename T, int NT>
struct LogitEpi {
    void* logits; int B; int V;
    __device__ __forceinline__ void operator()(int s, int, float (&acc)[NT][4], int lane) const {
        const int r = s * 16 + (lane >> 2), c = lane & 3;
#pragma unroll
        for (int t = 0; t < NT; ++t)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int b = t * 8 + 2 * c + e;
                if (b >= B) continue;
                stT<T>(logits, (long long)b * V + r, acc[t][e]);
                stT<T>(logits, (long long)b * V + r + 8, acc[t][2 + e]);
            }
    }
};

// ------------------------------------------------------------------ norm rows
// Warp per row: s = (embed) or round(resid + round(sum(parts) + bias)); s to resid_out (block
// 0) and the tile; then tile = round(s * rsqrt(mean(s^2) + eps) * w). A lane's chunks (up to
// NC of 8 values) are loaded together, the scale's with them: one round trip a row (more
// only beyond 32 * 8 * NC columns or for a second partial).
#define FD_NC 4
template <typename T>
__device__ __forceinline__ void norm_rows(T* tile, int KP, const FdParams& p, const void* resid,
                                          int nparts, const void* bias, const void* w,
                                          void* resid_out, bool embed) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int B = (int)p.B, H = (int)p.H, n8 = H / 8;
    for (int b = warp; b < B; b += FD_WARPS) {
        float ss = 0.f;
        T* trow = tile + (long long)b * KP;
        const long long tok = embed ? p.state[3 * p.stride + b] : 0;
        for (int g0 = 0; g0 < n8; g0 += 32 * FD_NC) {
            uint4 rv[FD_NC], wv[FD_NC];
            float4 pa[FD_NC], pb[FD_NC];
#pragma unroll
            for (int u = 0; u < FD_NC; ++u) {
                const int c8 = g0 + lane + 32 * u;
                if (c8 >= n8) continue;
                wv[u] = ld_w((const uint4*)((const T*)w + c8 * 8));
                if (embed) {
                    rv[u] = ld_w((const uint4*)((const T*)p.embed + tok * H + c8 * 8));
                } else {
                    rv[u] = ld_cg16((const T*)resid + (long long)b * H + c8 * 8);
                    if (nparts > 0) {
                        const float* pr = p.part + (long long)b * H + c8 * 8;
                        pa[u] = ld_cg4f(pr);
                        pb[u] = ld_cg4f(pr + 4);
                    }
                }
            }
#pragma unroll
            for (int u = 0; u < FD_NC; ++u) {
                const int c8 = g0 + lane + 32 * u;
                if (c8 >= n8) continue;
                float v[8];
                unpack8<T>(v, rv[u]);
                if (!embed && nparts > 0) {
                    float o[8] = {pa[u].x, pa[u].y, pa[u].z, pa[u].w, pb[u].x, pb[u].y, pb[u].z, pb[u].w};
                    for (int k = 1; k < nparts; ++k) {  // (a K split in several partials)
                        const float* pr = p.part + ((long long)k * B + b) * H + c8 * 8;
                        const float4 x = ld_cg4f(pr), y = ld_cg4f(pr + 4);
                        o[0] += x.x; o[1] += x.y; o[2] += x.z; o[3] += x.w;
                        o[4] += y.x; o[5] += y.y; o[6] += y.z; o[7] += y.w;
                    }
#pragma unroll
                    for (int e = 0; e < 8; ++e) {
                        const float bb = bias ? ldT<T>(bias, c8 * 8 + e) : 0.f;
                        v[e] = round_to<T>(v[e] + round_to<T>(o[e] + bb));
                    }
                }
                const uint4 sv = pack8<T>(v);
                rv[u] = sv;
                if (resid_out != nullptr && blockIdx.x == 0) *(uint4*)((T*)resid_out + (long long)b * H + c8 * 8) = sv;
#pragma unroll
                for (int e = 0; e < 8; ++e) ss += v[e] * v[e];
            }
            if (g0 + 32 * FD_NC < n8) {  // (rows longer than the registers: stage in the tile)
#pragma unroll
                for (int u = 0; u < FD_NC; ++u) {
                    const int c8 = g0 + lane + 32 * u;
                    if (c8 < n8) *(uint4*)(trow + c8 * 8) = rv[u];
                }
            } else {
                ss = warp_sum(ss);
                const float inv = rsqrtf(ss / (float)H + (float)p.eps);
                // the earlier groups (long rows) from the tile, the last from registers
                for (int c8 = lane; c8 < g0; c8 += 32) {
                    float v[8], ww[8];
                    unpack8<T>(v, *(const uint4*)(trow + c8 * 8));
                    unpack8<T>(ww, ld_w((const uint4*)((const T*)w + c8 * 8)));
#pragma unroll
                    for (int e = 0; e < 8; ++e) v[e] = v[e] * inv * ww[e];
                    *(uint4*)(trow + c8 * 8) = pack8<T>(v);
                }
#pragma unroll
                for (int u = 0; u < FD_NC; ++u) {
                    const int c8 = g0 + lane + 32 * u;
                    if (c8 >= n8) continue;
                    float v[8], ww[8];
                    unpack8<T>(v, rv[u]);
                    unpack8<T>(ww, wv[u]);
#pragma unroll
                    for (int e = 0; e < 8; ++e) v[e] = v[e] * inv * ww[e];
                    *(uint4*)(trow + c8 * 8) = pack8<T>(v);
                }
            }
        }
    }
}

// rows x K (T, written this launch) -> tile
template <typename T>
__device__ __forceinline__ void tile_load(T* tile, int KP, const void* src, int B, int K) {
    const int n8 = K / 8;
    for (int i = threadIdx.x; i < B * n8; i += FD_THREADS) {
        const int b = i / n8, c8 = i % n8;
        *(uint4*)(tile + (long long)b * KP + c8 * 8) = ld_cg16((const T*)src + (long long)b * K + c8 * 8);
    }
}

// ------------------------------------------------------------------ attention
// Item (split s, row b, kv head g): a warp computes the G = Hq / Hkv query heads of kv head g
// over keys [s * span, min(kv_len, (s + 1) * span)), span = 32 * ceil(kv_len / (32 * 64)).
// Per chunk of 32 keys, lane i loads key and value i (one table lookup, then both rows at
// once), scores its key against the G queries (in shared memory, broadcast), and stages its
// value row in shared memory; then each lane accumulates its HD / 32 dims over the chunk.
// One split: the output goes to `att`. Several: (m, l, acc[HD]) partials, and the last split
// to finish (a counter per (b, g)) combines them.
template <typename T, int HD>
__device__ __forceinline__ void attention_phase(const FdParams& p, const FdLayer& ly, float* qs_all,
                                                T* vs_all) {
    constexpr int PL = HD / 32;  // dims per lane
    constexpr int R8 = HD / 8;   // 16-byte pieces of a row
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int B = (int)p.B, Hq = (int)p.Hq, Hkv = (int)p.Hkv, G = Hq / Hkv;
    const long long BS = p.bs, MB = p.mb, NB = p.nb;
    float* qs = qs_all + warp * FD_GMAX * HD;
    T* vs = vs_all + warp * 32 * HD;
    const int per_s = B * Hkv;
    const int total = per_s * FD_MAX_SPLITS;
    // (consecutive items on different SMs)
    const int gw = warp * gridDim.x + blockIdx.x, nw = gridDim.x * FD_WARPS;
    const float sl2 = (float)p.scale_log2;
    for (int i = gw; i < total; i += nw) {
        const int s = i / per_s, b = (i % per_s) / Hkv, g = i % Hkv;
        const int kv_len = p.state[p.stride + b];
        if (kv_len <= 0) continue;
        const int span = 32 * ((kv_len + 32 * FD_MAX_SPLITS - 1) / (32 * FD_MAX_SPLITS));
        const int ns = (kv_len + span - 1) / span;
        if (s >= ns) continue;
        const int k0 = s * span, k1 = min(kv_len, k0 + span);
        // the group's queries (G * HD values, contiguous), pre-scaled into log2 units
        {
            const T* qg = (const T*)p.q + (long long)b * Hq * HD + g * G * HD;
            const int n8 = G * R8;
            uint4 qv[FD_GMAX * R8 / 32 + 1];
#pragma unroll
            for (int u = 0; u < FD_GMAX * R8 / 32 + 1; ++u) {
                const int x = lane + 32 * u;
                if (x < n8) qv[u] = ld_cg16(qg + x * 8);
            }
#pragma unroll
            for (int u = 0; u < FD_GMAX * R8 / 32 + 1; ++u) {
                const int x = lane + 32 * u;
                if (x < n8) {
                    float f[8];
                    unpack8<T>(f, qv[u]);
#pragma unroll
                    for (int e = 0; e < 8; ++e) qs[x * 8 + e] = f[e] * sl2;
                }
            }
        }
        __syncwarp();
        float m[FD_GMAX], l[FD_GMAX], acc[FD_GMAX][PL];
#pragma unroll
        for (int h = 0; h < FD_GMAX; ++h) {
            m[h] = NEG_INF; l[h] = 0.f;
#pragma unroll
            for (int e = 0; e < PL; ++e) acc[h][e] = 0.f;
        }
        const int* trow = p.table + (long long)b * MB;
        for (int j0 = k0; j0 < k1; j0 += 32) {
            const int j = j0 + lane;
            const bool valid = j < k1;
            float sc[FD_GMAX];
#pragma unroll
            for (int h = 0; h < FD_GMAX; ++h) sc[h] = 0.f;
            uint4 vr[R8];
            if (valid) {
                long long blk = trow[j / BS];
                if (blk < 0 || blk >= NB) blk = 0;
                const long long row = ((blk * p.Hkv + g) * BS + j % BS) * HD;
                const T* kp = (const T*)ly.kc + row;
                const T* vp = (const T*)ly.vc + row;
                uint4 kr[R8];
#pragma unroll
                for (int d8 = 0; d8 < R8; ++d8) kr[d8] = ld_cg16(kp + d8 * 8);
#pragma unroll
                for (int d8 = 0; d8 < R8; ++d8) vr[d8] = ld_cg16(vp + d8 * 8);
#pragma unroll
                for (int d8 = 0; d8 < R8; ++d8) {
                    float kf[8];
                    unpack8<T>(kf, kr[d8]);
#pragma unroll
                    for (int h = 0; h < FD_GMAX; ++h) {
                        if (h < G) {
#pragma unroll
                            for (int e = 0; e < 8; ++e) sc[h] += qs[h * HD + d8 * 8 + e] * kf[e];
                        }
                    }
                }
            } else {
#pragma unroll
                for (int d8 = 0; d8 < R8; ++d8) vr[d8] = make_uint4(0u, 0u, 0u, 0u);
            }
#pragma unroll
            for (int d8 = 0; d8 < R8; ++d8) *(uint4*)(vs + lane * HD + d8 * 8) = vr[d8];
            float pr[FD_GMAX];
#pragma unroll
            for (int h = 0; h < FD_GMAX; ++h) {
                if (h < G) {
                    const float mx = warp_max(valid ? sc[h] : NEG_INF);
                    const float mn = fmaxf(m[h], mx);
                    const float corr = exp2f(m[h] - mn);
                    pr[h] = valid ? exp2f(sc[h] - mn) : 0.f;
                    l[h] = l[h] * corr + warp_sum(pr[h]);
#pragma unroll
                    for (int e = 0; e < PL; ++e) acc[h][e] *= corr;
                    m[h] = mn;
                }
            }
            __syncwarp();
            const int n = min(32, k1 - j0);
            for (int x = 0; x < n; ++x) {
                float vf[PL];
#pragma unroll
                for (int e = 0; e < PL; e += 2) {
                    const u32 u = *(const u32*)(vs + x * HD + lane * PL + e);
                    vf[e] = lo_f<T>(u); vf[e + 1] = hi_f<T>(u);
                }
#pragma unroll
                for (int h = 0; h < FD_GMAX; ++h) {
                    if (h < G) {
                        const float ph = __shfl_sync(0xffffffffu, pr[h], x);
#pragma unroll
                        for (int e = 0; e < PL; ++e) acc[h][e] += ph * vf[e];
                    }
                }
            }
            __syncwarp();
        }
        if (ns == 1) {
#pragma unroll
            for (int h = 0; h < FD_GMAX; ++h) {
                if (h < G) {
                    const float inv = 1.f / l[h];
#pragma unroll
                    for (int e = 0; e < PL; ++e)
                        stT<T>(p.att, (long long)b * Hq * HD + (g * G + h) * HD + lane * PL + e, acc[h][e] * inv);
                }
            }
            __syncwarp();
            continue;
        }
        // partials, then the last split of (b, g) combines
#pragma unroll
        for (int h = 0; h < FD_GMAX; ++h) {
            if (h < G) {
                float* pp = p.attp + (((long long)b * Hq + g * G + h) * FD_MAX_SPLITS + s) * (HD + 2);
                if (lane == 0) { pp[0] = m[h]; pp[1] = l[h]; }
#pragma unroll
                for (int e = 0; e < PL; ++e) pp[2 + lane * PL + e] = acc[h][e];
            }
        }
        __syncwarp();
        u32 old = 0;
        if (lane == 0) {
            __threadfence();
            old = atomicAdd(p.done + b * Hkv + g, 1u);
        }
        old = __shfl_sync(0xffffffffu, old, 0);
        if ((int)old == ns - 1) {
            __threadfence();
            for (int h = 0; h < G; ++h) {
                const float* base = p.attp + ((long long)b * Hq + g * G + h) * FD_MAX_SPLITS * (HD + 2);
                // lane x < ns holds split x's (m, l); then every lane its dims of each split
                float mx = NEG_INF, lx = 0.f, mx2 = NEG_INF, lx2 = 0.f;
                if (lane < ns) { mx = ld_cgf(base + lane * (HD + 2)); lx = ld_cgf(base + lane * (HD + 2) + 1); }
                if (lane + 32 < ns) { mx2 = ld_cgf(base + (lane + 32) * (HD + 2)); lx2 = ld_cgf(base + (lane + 32) * (HD + 2) + 1); }
                const float mm = warp_max(fmaxf(mx, mx2));
                const float f1 = lane < ns ? exp2f(mx - mm) : 0.f;
                const float f2 = lane + 32 < ns ? exp2f(mx2 - mm) : 0.f;
                const float ll = warp_sum(lx * f1 + lx2 * f2);
                float o[PL];
#pragma unroll
                for (int e = 0; e < PL; ++e) o[e] = 0.f;
#pragma unroll 4
                for (int x = 0; x < ns; ++x) {
                    const float f = __shfl_sync(0xffffffffu, x < 32 ? f1 : f2, x & 31);
                    const float* q = base + x * (HD + 2) + 2 + lane * PL;
#pragma unroll
                    for (int e = 0; e < PL; ++e) o[e] += f * ld_cgf(q + e);
                }
                const float inv = 1.f / ll;
#pragma unroll
                for (int e = 0; e < PL; ++e)
                    stT<T>(p.att, (long long)b * Hq * HD + (g * G + h) * HD + lane * PL + e, o[e] * inv);
            }
            if (lane == 0) p.done[b * Hkv + g] = 0u;
        }
        __syncwarp();
    }
}

// ------------------------------------------------------------------ the kernel
template <typename T, int NT, int HD>
__global__ void __launch_bounds__(FD_THREADS, 1) fused_decode(const FdParams* __restrict__ pp) {
    extern __shared__ __align__(16) unsigned char fd_smem[];
    const FdParams& p = *pp;
    const int KP = (int)p.KP;
    T* tile = (T*)fd_smem;                                            // (8 NT, KP)
    float* red = (float*)(fd_smem + (size_t)8 * NT * KP * sizeof(T));  // (8 warps, NT, 4, 32)
    float* qs = red + FD_WARPS * NT * 4 * 32;                          // (8 warps, GMAX, HD)
    T* vs = (T*)(qs + FD_WARPS * FD_GMAX * HD);                         // (8 warps, 32, HD)
    const int B = (int)p.B, H = (int)p.H, Hq = (int)p.Hq, Hkv = (int)p.Hkv, F = (int)p.F;
    const int nL = (int)p.n_layers;
    const int ks_o = (int)p.ks_o, ks_d = (int)p.ks_d;
    const int s_qkv = (Hq + 2 * Hkv) * HD / 16, s_h = H / 16, s_gu = F / 8;
    const int k_h = H / 16, k_q = Hq * HD / 16, k_f = F / 16;
    const int wq = (int)p.wps_qkv, wo = (int)p.wps_o, wg = (int)p.wps_gu, wd = (int)p.wps_d;
    int tk = 0;
    const int vm = (int)p.variant;
    tick(p, tk);
    if (p.ticks != nullptr) {  // profiling: the cost of 64 barriers
        for (int i = 0; i < 64; ++i) grid_sync(p.bar);
        tick(p, tk);
    }
    const long long dt = 5 * (long long)nL + 3;  // phase C's detail ticks
    void* rcur = p.r0;
    void* rnext = p.r1;
    Pre pre;
    u32 arr;
    if (nL > 0) preload(pre, p.layers[0].wqkv, s_qkv, k_h, 1, wq);
    for (int L = 0; L < nL; ++L) {
        const FdLayer& ly = p.layers[L];
        const void* bd_prev = L > 0 ? p.layers[L - 1].bd : nullptr;
        // A: norm 1, QKV, RoPE, KV write
        if (!(vm & FD_SKIP_NORM)) norm_rows<T>(tile, KP, p, rcur, L > 0 ? ks_d : 0, bd_prev, ly.n1, rnext, L == 0);
        __syncthreads();
        if (!(vm & FD_SKIP_GEMV)) gemv_phase<T, NT>(pre, ly.wqkv, s_qkv, k_h, 1, wq, tile, KP, red, QkvEpi<T, NT, HD>{&p, &ly, B});
        arr = bar_arrive(p.bar);
        if (!(vm & FD_SKIP_PREFETCH)) prefetch_items(ly.wo, s_h, k_q, ks_o, wo, 4);
        bar_wait(p.bar, arr);
        if (vm & FD_DOUBLE_BAR) grid_sync(p.bar);
        tick(p, tk);
        // B: attention (nothing held in registers across it)
        if (!(vm & FD_SKIP_ATTN)) attention_phase<T, HD>(p, ly, qs, vs);
        arr = bar_arrive(p.bar);
        preload(pre, ly.wo, s_h, k_q, ks_o, wo);
        bar_wait(p.bar, arr);
        if (vm & FD_DOUBLE_BAR) grid_sync(p.bar);
        tick(p, tk);
        // C: O projection (partials)
        if (!(vm & FD_SKIP_TILE)) tile_load<T>(tile, KP, p.att, B, Hq * HD);
        __syncthreads();
        if (p.detail) tick_at(p, dt + 3 * L);
        if (!(vm & FD_SKIP_GEMV)) gemv_phase<T, NT>(pre, ly.wo, s_h, k_q, ks_o, wo, tile, KP, red, PartEpi<NT>{p.part, B, H});
        if (p.detail) tick_at(p, dt + 3 * L + 1);
        arr = bar_arrive(p.bar);
        if (p.detail) tick_at(p, dt + 3 * L + 2);
        preload(pre, ly.wgu, s_gu, k_h, 1, wg);
        if (!(vm & FD_SKIP_PREFETCH)) prefetch_items(ly.wgu, s_gu, k_h, 1, wg, 4);
        bar_wait(p.bar, arr);
        if (vm & FD_DOUBLE_BAR) grid_sync(p.bar);
        tick(p, tk);
        // D: norm 2, gate/up, SwiGLU
        if (!(vm & FD_SKIP_NORM)) norm_rows<T>(tile, KP, p, rnext, ks_o, ly.bo, ly.n2, rcur, false);
        __syncthreads();
        if (!(vm & FD_SKIP_GEMV)) gemv_phase<T, NT>(pre, ly.wgu, s_gu, k_h, 1, wg, tile, KP, red, SwigluEpi<T, NT>{p.act, ly.bgu, B, F});
        arr = bar_arrive(p.bar);
        preload(pre, ly.wd, s_h, k_f, ks_d, wd);
        if (!(vm & FD_SKIP_PREFETCH)) prefetch_items(ly.wd, s_h, k_f, ks_d, wd, 4);
        bar_wait(p.bar, arr);
        if (vm & FD_DOUBLE_BAR) grid_sync(p.bar);
        tick(p, tk);
        // E: down projection (partials)
        if (!(vm & FD_SKIP_TILE)) tile_load<T>(tile, KP, p.act, B, F);
        __syncthreads();
        if (!(vm & FD_SKIP_GEMV)) gemv_phase<T, NT>(pre, ly.wd, s_h, k_f, ks_d, wd, tile, KP, red, PartEpi<NT>{p.part, B, H});
        arr = bar_arrive(p.bar);
        if (L + 1 < nL) {
            preload(pre, p.layers[L + 1].wqkv, s_qkv, k_h, 1, wq);
            if (!(vm & FD_SKIP_PREFETCH)) prefetch_items(p.layers[L + 1].wqkv, s_qkv, k_h, 1, wq, 4);
        } else {
            preload(pre, p.w_head, (int)(p.V / 16), k_h, 1, (int)p.wps_head);
            if (!(vm & FD_SKIP_PREFETCH)) prefetch_items(p.w_head, (int)(p.V / 16), k_h, 1, (int)p.wps_head, 4);
        }
        bar_wait(p.bar, arr);
        if (vm & FD_DOUBLE_BAR) grid_sync(p.bar);
        tick(p, tk);
    }
    if (nL == 0) preload(pre, p.w_head, (int)(p.V / 16), k_h, 1, (int)p.wps_head);
    // final norm, LM head
    if (!(vm & FD_SKIP_NORM)) norm_rows<T>(tile, KP, p, rcur, ks_d, nL > 0 ? p.layers[nL - 1].bd : nullptr, p.norm_f, nullptr,
                 nL == 0);
    __syncthreads();
    if (!(vm & FD_SKIP_GEMV)) gemv_phase<T, NT>(pre, p.w_head, (int)(p.V / 16), k_h, 1, (int)p.wps_head, tile, KP, red,
                      LogitEpi<T, NT>{p.logits, B, (int)p.V});
    tick(p, tk);
}
