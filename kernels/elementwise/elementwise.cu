// Elementwise kernels: saxpy, add, mul, and a slow copy used by tests.
//
// Storage types for the 16-bit floats are plain structs converted with PTX
// `cvt` (no cuda_fp16.h / cuda_bf16.h needed under NVRTC). Floating types
// compute in float32; integer types compute natively (add, mul) or in double
// (saxpy, truncated back toward zero, as NumPy's astype does).
//
// Launch shape: the tensor is seen as (rows, cols) = (prod(shape[:-1]), shape[-1]);
// block (bx, by) handles the tile rows [by*tr, by*tr+tr) x cols [bx*tc, bx*tc+tc),
// threads stride over the tr*tc elements of the tile; grid.y folds when > 65535.

#include "float16_types.cuh"

// Integer storage computes in double (saxpy), truncated back toward zero on store.
__device__ __forceinline__ double ld(int v) { return (double)v; }
__device__ __forceinline__ double ld(long long v) { return (double)v; }
__device__ __forceinline__ void st(int& d, double v) { d = (int)v; }
__device__ __forceinline__ void st(long long& d, double v) { d = (long long)v; }

template <typename T> __device__ __forceinline__ T add_(T a, T b) { T r; st(r, ld(a) + ld(b)); return r; }
template <> __device__ __forceinline__ int add_(int a, int b) { return a + b; }
template <> __device__ __forceinline__ long long add_(long long a, long long b) { return a + b; }
template <typename T> __device__ __forceinline__ T mul_(T a, T b) { T r; st(r, ld(a) * ld(b)); return r; }
template <> __device__ __forceinline__ int mul_(int a, int b) { return a * b; }
template <> __device__ __forceinline__ long long mul_(long long a, long long b) { return a * b; }

// Programmatic dependent launch (sm_90+): wait for the previous kernel's
// results, then let the next kernel begin launching. No-ops when launched
// without the attribute.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define PDL_PROLOGUE asm volatile("griddepcontrol.wait;" ::: "memory"); \
                     asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#else
#define PDL_PROLOGUE
#endif

#define TILE_LOOP                                                                   \
    PDL_PROLOGUE                                                                    \
    const int n = tr * tc;                                                          \
    for (long long by = blockIdx.y; by * tr < rows; by += gridDim.y)                \
        for (int e = threadIdx.x; e < n; e += blockDim.x) {                         \
            const long long r = by * tr + e / tc;                                   \
            const long long c = (long long)blockIdx.x * tc + e % tc;                \
            if (r >= rows || c >= cols) continue;                                   \
            const long long i = r * cols + c;

// z = a * x + z   (z: (rows, cols), x: same)
template <typename T>
__global__ void saxpy(T* __restrict__ z, float a, const T* __restrict__ x,
                      long long rows, long long cols, int tr, int tc) {
    TILE_LOOP
        st(z[i], a * ld(x[i]) + ld(z[i]));
    }
}

// out = x + y   (all (rows, cols))
template <typename T>
__global__ void add(T* __restrict__ out, const T* __restrict__ x, const T* __restrict__ y,
                    long long rows, long long cols, int tr, int tc) {
    TILE_LOOP
        out[i] = add_(x[i], y[i]);
    }
}

// out = x * y
template <typename T>
__global__ void mul(T* __restrict__ out, const T* __restrict__ x, const T* __restrict__ y,
                    long long rows, long long cols, int tr, int tc) {
    TILE_LOOP
        out[i] = mul_(x[i], y[i]);
    }
}

// Flat variants for unpartitioned tensors: one element per thread, grid-stride
// (no per-element division), the common case of the eager and graph hot paths.
#define FLAT_LOOP                                                                   \
    PDL_PROLOGUE                                                                    \
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;     \
         i += (long long)gridDim.x * blockDim.x)

template <typename T>
__global__ void saxpy_flat(T* __restrict__ z, float a, const T* __restrict__ x, long long n) {
    FLAT_LOOP st(z[i], a * ld(x[i]) + ld(z[i]));
}

template <typename T>
__global__ void add_flat(T* __restrict__ out, const T* __restrict__ x, const T* __restrict__ y, long long n) {
    FLAT_LOOP out[i] = add_(x[i], y[i]);
}

template <typename T>
__global__ void mul_flat(T* __restrict__ out, const T* __restrict__ x, const T* __restrict__ y, long long n) {
    FLAT_LOOP out[i] = mul_(x[i], y[i]);
}

// Test helper: spin for `cycles` clock cycles, then dst = src (one block, byte copy).
// Makes a long-running reader/writer to provoke cross-stream races on purpose.
extern "C" __global__ void slow_copy(unsigned char* dst, const unsigned char* src,
                                     long long nbytes, long long cycles) {
    const long long t0 = clock64();
    while (clock64() - t0 < cycles) { }
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < nbytes;
         i += (long long)gridDim.x * blockDim.x)
        dst[i] = src[i];
}
