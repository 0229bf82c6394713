// Logits adjustments and log-probabilities around sample<T> (sampling.cu). Launchers:
// kernels/sampling/_cuda.py.
//
// penalize<T>: grid (x blocks, B); rows with mode & 1, in place:
//   x_i = (x_i + bias_i) - (presence + frequency * count_i)   where count_i > 0,
//   x_i = x_i + bias_i                                          elsewhere;
//   computed in float32, stored rounded to T. Other rows return at once.
// logprobs<T>: one block per row.
//   mode & 1: counts[tok] += 1 (thread 0; tok outside [0, V) is skipped);
//   mode & 2: lse = max + log(sum exp(x - max)) (one pass, online); out[0] = x[tok] - lse;
//     then K rounds of a block argmax over the items after the previous pick in the order
//     (value descending, index ascending): out[1 + r] = x - lse, ids[r] = index (-inf, -1
//     once the row is exhausted). Cost: 1 + K passes over the row, for the rows that ask.
//   Other rows return at once. NaN logits are not supported.
// mask_logits<T>: grid (x blocks, B); rows with mode & 4, in place: x_i = -inf where bit
//   (i & 31) of bitmask[b][i >> 5] is 0 (a grammar's allowed-token mask, LSB first).
//   Other rows return at once.

#include "rows.cuh"

template <typename T>
__global__ void penalize(T* __restrict__ logits, const int* __restrict__ counts,
                         const float* __restrict__ bias, const float* __restrict__ presence,
                         const float* __restrict__ frequency, const int* __restrict__ mode,
                         int V) {
    const int b = blockIdx.y;
    if (!(mode[b] & 1)) return;
    const float pr = presence[b], fr = frequency[b];
    const long long o = (long long)b * V;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < V; i += gridDim.x * blockDim.x) {
        const int c = counts[o + i];
        float v = ld(logits[o + i]) + bias[o + i];
        if (c > 0) v = v - (pr + fr * (float)c);
        st(logits[o + i], v);
    }
}

template <typename T>
__global__ void __launch_bounds__(1024) logprobs(float* __restrict__ out, int* __restrict__ ids,
                                                 int* __restrict__ counts,
                                                 const T* __restrict__ logits,
                                                 const int* __restrict__ tokens,
                                                 const int* __restrict__ mode, int V, int K) {
    __shared__ float shv[32];
    __shared__ int shi[32];
    const int b = blockIdx.x, tid = threadIdx.x;
    const int md = mode[b];
    if (!(md & 3)) return;
    const int tok = tokens[b];
    if ((md & 1) && tid == 0 && tok >= 0 && tok < V) counts[(long long)b * V + tok] += 1;
    if (!(md & 2)) return;
    const T* x = logits + (long long)b * V;
    // the log-sum-exp: per-thread online (max, sum), then the block's
    float m = NEG_INF, s = 0.f;
    for (int i = tid; i < V; i += blockDim.x) {
        const float v = ld(x[i]);
        if (v > m) {
            s = (m == NEG_INF ? 0.f : s * expf(m - v)) + 1.f;
            m = v;
        } else if (v > NEG_INF) {
            s += expf(v - m);
        }
    }
    float bm = m;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) bm = fmaxf(bm, __shfl_xor_sync(0xffffffffu, bm, o));
    const int lane = tid & 31, w = tid >> 5, nw = (blockDim.x + 31) >> 5;
    if (lane == 0) shv[w] = bm;
    __syncthreads();
    bm = lane < nw ? shv[lane] : NEG_INF;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) bm = fmaxf(bm, __shfl_xor_sync(0xffffffffu, bm, o));
    const float part = m == NEG_INF ? 0.f : s * expf(m - bm);
    const float lse = bm + logf(block_sum(part, shv));
    float* o = out + (long long)b * (K + 1);
    int* oi = ids + (long long)b * K;
    if (tid == 0) o[0] = (tok >= 0 && tok < V) ? ld(x[tok]) - lse : NEG_INF;
    // the top K, one block argmax per rank
    float pv = __int_as_float(0x7f800000);  // +inf
    int pi = -1;
    for (int r = 0; r < K; ++r) {
        float bv = NEG_INF;
        int bi = 0x7fffffff;
        for (int i = tid; i < V; i += blockDim.x) {
            const float v = ld(x[i]);
            const bool after_prev = v < pv || (v == pv && i > pi);
            if (after_prev && DescendingOrder::first(v, i, bv, bi)) { bv = v; bi = i; }
        }
        group_first<DescendingOrder>(bv, bi, blockDim.x, shv, shi);
        if (bi == 0x7fffffff) {  // no item left: the rest are -inf / -1
            for (int q = r + tid; q < K; q += blockDim.x) { o[1 + q] = NEG_INF; oi[q] = -1; }
            return;
        }
        if (tid == 0) { o[1 + r] = bv - lse; oi[r] = bi; }
        pv = bv;
        pi = bi;
    }
}

template <typename T>
__global__ void mask_logits(T* __restrict__ logits, const int* __restrict__ bitmask,
                            const int* __restrict__ mode, int V, int W) {
    const int b = blockIdx.y;
    if (!(mode[b] & 4)) return;
    const long long o = (long long)b * V;
    const int* m = bitmask + (long long)b * W;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < V; i += gridDim.x * blockDim.x) {
        if (!((((unsigned)m[i >> 5]) >> (i & 31)) & 1u)) st(logits[o + i], NEG_INF);
    }
}
