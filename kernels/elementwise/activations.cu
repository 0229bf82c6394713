// Activation kernels: softmax (row-wise over the last dim), gelu, silu (elementwise) and
// swiglu and geglu (gate_up (rows, 2F) -> (rows, F)). Launchers: kernels/elementwise/_cuda.py.
// In-place use (out == x) is allowed for softmax, gelu and silu.
// Storage types for the 16-bit floats are plain structs converted with PTX `cvt` (no
// cuda_fp16.h / cuda_bf16.h needed under NVRTC). Every kernel loads its inputs as float32,
// accumulates in float32 and rounds once on store.

#include "rows.cuh"

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

// ---------------------------------------------------------------------------- geglu
// gate_up (rows, 2F) -> out (rows, F): gelu_tanh(gate) * up (Gemma's MLP), as swiglu.
template <typename T, int VEC>
__global__ void geglu(T* out, const T* gate_up, long long rows, int F) {
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
        for (int e = 0; e < VEC; ++e) {
            const float v = a[e];
            a[e] = 0.5f * v * (1.f + tanhf(0.7978845608028654f * (v + 0.044715f * v * v * v))) * b[e];
        }
        store_vec<T, VEC>(out + r * F + c, a);
    }
}
