// Lookup kernels: argmax (row-wise over the last dim) and embedding (row gather).
// Launchers: kernels/lookup/_cuda.py.
// Storage types for the 16-bit floats are plain structs converted with PTX `cvt` (no
// cuda_fp16.h / cuda_bf16.h needed under NVRTC). Every kernel loads its inputs as float32,
// accumulates in float32 and rounds once on store.

#include "rows.cuh"

// The elements of one 16-byte vector, columns c0, c0 + 1, ...
template <typename T>
__device__ __forceinline__ void argmax_vec(const uint4& u, int c0, float& bv, int& bi) {
    const T* e = reinterpret_cast<const T*>(&u);
#pragma unroll
    for (int j = 0; j < 16 / (int)sizeof(T); ++j) {
        const float v = ld(e[j]);
        if (ArgmaxOrder::first(v, c0 + j, bv, bi)) { bv = v; bi = c0 + j; }
    }
}

// One thread's share of a row: 16-byte vectors t, t + tpr, ... (four loads in flight) when
// the row is 16-byte aligned, then the columns past the last whole vector one by one.
// The visiting order does not matter: ArgmaxOrder (rows.cuh) breaks ties by index.
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
        if (ArgmaxOrder::first(v, c, bv, bi)) { bv = v; bi = c; }
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
        group_first<ArgmaxOrder>(bv, bi, tpr, shv, shi);
        if (t == 0) out[r] = (I)bi;
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
