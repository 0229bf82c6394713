// Split-K reduction + epilogue: out = act(alpha * sum_s ws[s] + beta * out_prev + bias).
//   ws: (splits, batch * M, N) float32 partial products; out: (batch * M, N), 16-bit
//   (GEMM_OUT_F32 = 0, f16 / bf16 per GEMM_BF16) or float32 (GEMM_OUT_F32 = 1).
// Grid-stride over batch * M * N outputs; each thread reduces one output.
#include "gemm_common.cuh"

#ifndef GEMM_OUT_F32
#define GEMM_OUT_F32 0
#endif
#if GEMM_OUT_F32
typedef float out_t;
__device__ __forceinline__ float o2f(out_t x) { return x; }
__device__ __forceinline__ out_t f2o(float x) { return x; }
#else
typedef u16 out_t;
__device__ __forceinline__ float o2f(out_t x) { return h2f(x); }
__device__ __forceinline__ out_t f2o(float x) { return f2h(x); }
#endif

extern "C" __global__ void __launch_bounds__(256)
    gemm_splitk_reduce(const float* __restrict__ ws, out_t* __restrict__ out, const out_t* __restrict__ bias,
                       long long total, int N, int splits, float alpha, float beta, int act, int has_bias,
                       int has_beta) {
  const Epi e{alpha, beta, act, has_bias, has_beta};
  pdl_wait();  // the GEMM's partials (launched with programmatic dependent launch on sm_90)
  pdl_launch_dependents();
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
       i += (long long)gridDim.x * blockDim.x) {
    float s = 0.f;
    for (int k = 0; k < splits; ++k) s += ws[(size_t)k * total + i];
    const int col = (int)(i % N);
    const float prev = has_beta ? o2f(out[i]) : 0.f;
    const float bv = has_bias ? o2f(bias[col]) : 0.f;
    out[i] = f2o(epi_apply(e, s, prev, bv));
  }
}
