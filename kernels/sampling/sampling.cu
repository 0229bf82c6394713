// Token sampling: sample<T>, one block per row of logits (B, V). Launcher: kernels/sampling/_cuda.py.
//
// Row b:
//   u = uniform(seed[b], counter[b]); counter[b] += 1 (every row, greedy ones too);
//   temperature <= 0 (or 1/temperature not finite, or a max that is not finite): out = argmax
//     (first max; NaN wins);
//   else w_i = exp((x_i - max) / temperature) over the kept set:
//     top-k: x_i >= the k-th largest value (ties at the threshold kept, as HF's warper), then
//     top-p: x_i >= the largest value t whose kept mass {x >= t} reaches top_p * sum(w);
//   out = the first index i (index order) where the running sum of kept w exceeds u * sum.
//
// No sort. Thresholds are radix selects on an order-preserving 32-bit key of the value (four
// 8-bit digits, shared-memory histograms: counts with warp-aggregated atomics for ranks,
// weights for masses). Where top-k or top-p is on, the top K0 values (K0 = k, or CAP without
// top-k) are first compacted, in index order, into shared memory (when they fit), and top-p
// and the draw run on that list; without top-k this needs the list's mass to reach top_p
// (usual for language-model logits), else the row path runs. The draw is two-level: warp
// chunk sums, the block scans the chunk holding u * sum, one thread walks a few items.
// All passes over the row are coalesced.

#include "rows.cuh"

#define SAMPLE_CAP 2048

// The same hash as kernels/sampling/_reference.py (splitmix64's finalizer, twice).
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

struct SampleShared {
    unsigned hist_u[256];
    float hist_f[256];
    float pre[33];
    float shf[32];
    int shi[33];
    int bin, pick, last;
    unsigned above_u;
    float above_f;
    float cand_v[SAMPLE_CAP];
    float cand_w[SAMPLE_CAP];
    int cand_i[SAMPLE_CAP];
};

// Key of the rank-th largest (1-based, rank <= n) of n items; keyf(i) gives item i's key.
template <typename KF>
__device__ unsigned radix_rank(KF keyf, int n, unsigned rank, SampleShared& sh) {
    const int lane = threadIdx.x & 31;
    unsigned prefix = 0u, mask = 0u;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int q = threadIdx.x; q < 256; q += blockDim.x) sh.hist_u[q] = 0u;
        __syncthreads();
        for (int base = 0; base < n; base += 4 * blockDim.x) {  // whole warps: full-mask match
            unsigned bins[4];
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                const int i = base + r * blockDim.x + threadIdx.x;
                bins[r] = 256u;
                if (i < n) {
                    const unsigned key = keyf(i);
                    if ((key & mask) == prefix) bins[r] = (key >> shift) & 255u;
                }
            }
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                const unsigned peers = __match_any_sync(0xffffffffu, bins[r]);
                if (bins[r] < 256u && lane == __ffs(peers) - 1)
                    atomicAdd(&sh.hist_u[bins[r]], (unsigned)__popc(peers));
            }
        }
        __syncthreads();
        pick_bin<unsigned>(sh.hist_u, 0u, rank, &sh.bin, &sh.above_u);
        __syncthreads();
        rank -= sh.above_u;  // a bin always exists: rank <= the count under the prefix
        prefix |= (unsigned)sh.bin << shift;
        mask |= 255u << shift;
        __syncthreads();
    }
    return prefix;
}

// The largest key t such that the weight of the items with key >= max(t, thr) reaches
// `need`; false (no such t: float rounding at the top) leaves *result unset.
template <typename KF, typename WF>
__device__ bool radix_mass(KF keyf, WF wf, int n, unsigned thr, float need, SampleShared& sh,
                           unsigned* result) {
    unsigned prefix = 0u, mask = 0u;
    float above = 0.f;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int q = threadIdx.x; q < 256; q += blockDim.x) sh.hist_f[q] = 0.f;
        __syncthreads();
#pragma unroll 4
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
            const unsigned key = keyf(i);
            if (key >= thr && (key & mask) == prefix) atomicAdd(&sh.hist_f[(key >> shift) & 255u], wf(i));
        }
        __syncthreads();
        pick_bin<float>(sh.hist_f, above, need, &sh.bin, &sh.above_f);
        __syncthreads();
        const int bin = sh.bin;
        if (bin < 0) return false;  // uniform: every thread read the same bin
        above = sh.above_f;
        prefix |= (unsigned)bin << shift;
        mask |= 255u << shift;
        __syncthreads();
    }
    *result = prefix;
    return true;
}

// Index-ordered inverse CDF over n items of weight wf(i) >= 0 (0: not kept, sum > 0): the
// first i whose running sum exceeds u * sum. Level 1: warp w sums the contiguous chunk w;
// level 2: the block scans the chunk holding the target, each thread a few items.
template <typename WF>
__device__ int block_draw(WF wf, int n, float u, SampleShared& sh) {
    const int tid = threadIdx.x, lane = tid & 31, wid = tid >> 5, nw = blockDim.x >> 5;
    const int C = (n + nw - 1) / nw;
    const int lo = min(wid * C, n), hi = min(lo + C, n);
    float s = 0.f;
#pragma unroll 4
    for (int i = lo + lane; i < hi; i += 32) s += wf(i);
    s = warp_sum(s);
    __syncthreads();
    if (lane == 0) sh.shf[wid] = s;
    if (tid == 0) { sh.pick = -1; sh.last = -1; }
    __syncthreads();
    if (tid == 0) {
        float run = 0.f;
        for (int q = 0; q < nw; ++q) { sh.pre[q] = run; run = run + sh.shf[q]; }
        sh.pre[nw] = run;
    }
    __syncthreads();
    const float target = u * sh.pre[nw];  // < the total (u <= 1 - 2^-24)
    int q = 0;
    while (q < nw - 1 && !(target < sh.pre[q + 1])) ++q;  // pre[q] <= target < pre[q + 1]
    const int clo = min(q * C, n), chi = min(clo + C, n);
    const int E = (chi - clo + (int)blockDim.x - 1) / (int)blockDim.x;
    const int a = min(clo + tid * E, chi), b = min(a + E, chi);
    float s2 = 0.f;
    int last = -1;
    for (int i = a; i < b; ++i) {
        const float w = wf(i);
        if (w > 0.f) { s2 += w; last = i; }
    }
    float incl = s2;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const float t = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += t;
    }
    const float prev = __shfl_up_sync(0xffffffffu, incl, 1);
    __syncthreads();  // shf is rewritten
    if (lane == 31) sh.shf[wid] = incl;
    if (last >= 0) atomicMax(&sh.last, last);
    __syncthreads();
    if (tid == 0) {
        float run = sh.pre[q];
        for (int w = 0; w < nw; ++w) { const float t = sh.shf[w]; sh.shf[w] = run; run = run + t; }
    }
    __syncthreads();
    const float off = sh.shf[wid];
    const float lo_s = lane ? prev + off : off;  // == the previous thread's hi_s, bit for bit
    const float hi_s = incl + off;
    if (s2 > 0.f && lo_s <= target && target < hi_s) {
        float run = lo_s;
        int pk = last;  // float rounding: the thread's last kept item
        for (int i = a; i < b; ++i) {
            const float w = wf(i);
            if (w > 0.f) {
                run += w;
                if (run > target) { pk = i; break; }
            }
        }
        sh.pick = pk;
    }
    __syncthreads();
    // no thread won: float rounding at the chunk end (an empty set cannot reach here: the
    // row's maximum is always kept with weight 1; max(.., 0) only keeps indices in range)
    const int r = max(sh.pick >= 0 ? sh.pick : sh.last, 0);
    __syncthreads();
    return r;
}

// The row's items with key >= thr, in index order, into cand_v / cand_i when they fit
// (<= SAMPLE_CAP); returns their count. Warp w owns the contiguous chunk w.
template <typename T>
__device__ int compact(const T* x, int V, unsigned thr, SampleShared& sh) {
    const int tid = threadIdx.x, lane = tid & 31, wid = tid >> 5, nw = blockDim.x >> 5;
    const int C = (V + nw - 1) / nw;
    const int lo = min(wid * C, V), hi = min(lo + C, V);
    int cnt = 0;
#pragma unroll 4
    for (int base = lo; base < hi; base += 32) {
        const int i = base + lane;
        const bool f = i < hi && fkey(ld(x[i])) >= thr;
        cnt += __popc(__ballot_sync(0xffffffffu, f));
    }
    __syncthreads();
    if (lane == 0) sh.shi[wid] = cnt;
    __syncthreads();
    if (tid == 0) {
        int run = 0;
        for (int q = 0; q < nw; ++q) { const int t = sh.shi[q]; sh.shi[q] = run; run += t; }
        sh.shi[32] = run;
    }
    __syncthreads();
    const int total = sh.shi[32];
    if (total <= SAMPLE_CAP) {
        int pos = sh.shi[wid];
#pragma unroll 4
        for (int base = lo; base < hi; base += 32) {
            const int i = base + lane;
            float v = 0.f;
            bool f = false;
            if (i < hi) {
                v = ld(x[i]);
                f = fkey(v) >= thr;
            }
            const unsigned bal = __ballot_sync(0xffffffffu, f);
            if (f) {
                const int idx = pos + __popc(bal & ((1u << lane) - 1u));
                sh.cand_v[idx] = v;
                sh.cand_i[idx] = i;
            }
            pos += __popc(bal);
        }
    }
    __syncthreads();
    return total;
}

template <typename T>
__global__ void __launch_bounds__(1024) sample(int* __restrict__ out, long long* __restrict__ counter,
                                               const T* __restrict__ logits,
                                               const float* __restrict__ temperature,
                                               const int* __restrict__ top_k,
                                               const float* __restrict__ top_p,
                                               const long long* __restrict__ seed, int V) {
    __shared__ SampleShared sh;
    const int b = blockIdx.x, tid = threadIdx.x;
    const T* x = logits + (long long)b * V;  // (V,)
    const float temp = temperature[b];
    const int k = top_k[b];
    const float p = top_p[b];
    const long long ctr = counter[b];
    const float u = uniform01(seed[b], ctr);
    const float inv_t = 1.f / temp;
    const bool sampling = temp > 0.f && isfinite(inv_t);

    // pass 1: max, first argmax, and (sampling) the online sum of exp((x - max) / t)
    float bv = __int_as_float(0xff800000), sm = bv, ss = 0.f;
    int bi = 0x7fffffff;
#pragma unroll 4
    for (int i = tid; i < V; i += blockDim.x) {
        const float v = ld(x[i]);
        if (ArgmaxOrder::first(v, i, bv, bi)) { bv = v; bi = i; }
        if (sampling && v > __int_as_float(0xff800000)) {  // (NaN and -inf skipped)
            if (v > sm) {
                ss = ss * expf((sm - v) * inv_t) + 1.f;
                sm = v;
            } else {
                ss += expf((v - sm) * inv_t);
            }
        }
    }
    group_first<ArgmaxOrder>(bv, bi, blockDim.x, sh.shf, sh.shi);
    if (tid == 0) counter[b] = ctr + 1;  // every thread read counter[b] above this point
    const float m = bv;
    if (!sampling || !isfinite(m)) {
        if (tid == 0) out[b] = bi;
        return;
    }
    // the row's total weight (used by top-p without top-k)
    const float z_row = block_sum(ss * expf((sm - m) * inv_t), sh.shf);

    const bool topk = k > 0 && k < V, topp = p < 1.f;
    auto row_key = [&](int i) { return fkey(ld(x[i])); };
    int pick = -1;
    if (topk || topp) {
        const int k0 = topk ? k : min(SAMPLE_CAP, V);
        const unsigned thr0 = k0 < V ? radix_rank(row_key, V, (unsigned)k0, sh) : 0u;
        const int n = compact(x, V, thr0, sh);
        bool use_list = n <= SAMPLE_CAP;
        if (use_list) {
            for (int j = tid; j < n; j += blockDim.x) sh.cand_w[j] = expf((sh.cand_v[j] - m) * inv_t);
            __syncthreads();
            unsigned thr = 0u;
            if (topp) {
                float t = 0.f;
                for (int j = tid; j < n; j += blockDim.x) t += sh.cand_w[j];
                const float zl = block_sum(t, sh.shf);
                const float need = fmaxf(p * (topk ? zl : z_row), 1.17549435e-38f);
                if (!topk && zl < need) use_list = false;  // the list holds too little mass
                if (use_list) {
                    unsigned tp;
                    auto lkey = [&](int j) { return fkey(sh.cand_v[j]); };
                    auto lw = [&](int j) { return sh.cand_w[j]; };
                    if (radix_mass(lkey, lw, n, 0u, need, sh, &tp)) thr = tp;
                }
            }
            if (use_list) {
                auto lw = [&](int j) { return fkey(sh.cand_v[j]) >= thr ? sh.cand_w[j] : 0.f; };
                const int j = block_draw(lw, n, u, sh);
                pick = sh.cand_i[j];
            }
        }
        if (!use_list) {  // the row path: thresholds and the draw over the whole row
            unsigned thr = topk ? thr0 : 0u;
            auto rw = [&](int i) {
                const float v = ld(x[i]);
                return fkey(v) >= thr ? expf((v - m) * inv_t) : 0.f;
            };
            if (topp) {
                float z = z_row;
                if (topk) {
                    float t = 0.f;
                    for (int i = tid; i < V; i += blockDim.x) t += rw(i);
                    z = block_sum(t, sh.shf);
                }
                const float need = fmaxf(p * z, 1.17549435e-38f);
                unsigned tp;
                if (radix_mass(row_key, rw, V, thr, need, sh, &tp) && tp > thr) thr = tp;
            }
            pick = block_draw(rw, V, u, sh);
        }
    } else {
        auto rw = [&](int i) { return expf((ld(x[i]) - m) * inv_t); };
        pick = block_draw(rw, V, u, sh);
    }
    if (tid == 0) out[b] = pick;
}
