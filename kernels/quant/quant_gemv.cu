// Quantized-weight GEMV and dequantization: GGUF blocks (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K)
// dequantized in registers, float32 accumulation. The formats, the weight's layout (rows of
// blocks padded to 16 bytes, w_stride bytes apart) and the 32-element unit of work are in
// quant_formats.cuh.
//
// quant_gemv<F, MR, T>: out[m0 + r, out_col + n] = sum_k x[m0 + r, k] W[n, k] (+ bias[n]),
// r < min(MR, M - m0), m0 = blockIdx.y MR. One warp per weight row n (QG_WARPS rows a block):
// lane l takes units l, l + 32, ... of the row (consecutive lanes read consecutive blocks: a
// warp reads its row front to back, each unit once), QG_U of them at a time with all their
// loads issued first, dequantizes each in registers (quant_formats.cuh) and multiplies it with
// the MR activation rows (16-byte loads of x when x_vec); the MR sums are reduced over the
// warp by shuffles, lane r writes row r. x and out: T = float, f16 or bf16.
//
// quant_dequant<F, T>: out[i, :] = W[row_i, :] dequantized, row_i = i (ids null), else the
// clamped id (id_kind 1: int32, 2: int64). Blocks stride over rows, threads over units.
#include "float16_types.cuh"
#include "quant_formats.cuh"

#ifndef QG_WARPS
#define QG_WARPS 4
#endif

// 8 activations at p (as float); vec: one 16-byte load (f16/bf16) or two (float)
__device__ __forceinline__ void load_x8(const f16* p, float (&v)[8], int vec) {
  if (vec) {
    const uint4 q = __ldg(reinterpret_cast<const uint4*>(p));
    const u32 a[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      v[2 * i] = half_bits(a[i] & 0xFFFFu);
      v[2 * i + 1] = half_bits(a[i] >> 16);
    }
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = ld(p[i]);
  }
}
__device__ __forceinline__ void load_x8(const bf16* p, float (&v)[8], int vec) {
  if (vec) {
    const uint4 q = __ldg(reinterpret_cast<const uint4*>(p));
    const u32 a[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      v[2 * i] = __uint_as_float(a[i] << 16);
      v[2 * i + 1] = __uint_as_float(a[i] & 0xFFFF0000u);
    }
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = ld(p[i]);
  }
}
__device__ __forceinline__ void load_x8(const float* p, float (&v)[8], int vec) {
  if (vec) {
    const float4 a = __ldg(reinterpret_cast<const float4*>(p));
    const float4 c = __ldg(reinterpret_cast<const float4*>(p + 4));
    v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
    v[4] = c.x; v[5] = c.y; v[6] = c.z; v[7] = c.w;
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = p[i];
  }
}

template <int F, int MR, typename T>
__global__ void __launch_bounds__(QG_WARPS * 32)
    quant_gemv(const u8* __restrict__ W, long long w_stride, const T* __restrict__ X, T* __restrict__ out,
               const T* __restrict__ bias, int M, int N, int K, int ldo, int out_col, int has_bias, int x_vec) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int n = blockIdx.x * QG_WARPS + warp;
  if (n >= N) return;  // (no block-wide barrier below)
  const int m0 = blockIdx.y * MR;
  const int rows = min(MR, M - m0);
  const u8* row = W + (size_t)n * (size_t)w_stride;
  const T* Xb = X + (size_t)m0 * K;
  float acc[MR];
#pragma unroll
  for (int r = 0; r < MR; ++r) acc[r] = 0.f;
  const int units = K >> 5;
  // QG_U units a lane: their loads all issued before the first is used (latency hidden)
  constexpr int QG_U = MR <= 4 ? 4 : (MR <= 16 ? 2 : 1);
  for (int u0 = lane; u0 < units; u0 += 32 * QG_U) {
    Raw<F> raw[QG_U];
#pragma unroll
    for (int j = 0; j < QG_U; ++j)
      if (u0 + 32 * j < units) raw[j].load(row, u0 + 32 * j);
#pragma unroll
    for (int j = 0; j < QG_U; ++j) {
      const int u = u0 + 32 * j;
      if (u < units) {
        float w[32];
        raw[j].deq(w);
#pragma unroll
        for (int r = 0; r < MR; ++r) {
          if (r < rows) {
            const T* xp = Xb + (size_t)r * K + 32 * u;
#pragma unroll
            for (int c = 0; c < 4; ++c) {
              float xv[8];
              load_x8(xp + 8 * c, xv, x_vec);
#pragma unroll
              for (int i = 0; i < 8; ++i) acc[r] = fmaf(xv[i], w[8 * c + i], acc[r]);
            }
          }
        }
      }
    }
  }
#pragma unroll
  for (int r = 0; r < MR; ++r) {
    if (r < rows) {  // (uniform over the warp)
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], o);
    }
  }
  const float bv = has_bias ? ld(bias[n]) : 0.f;
#pragma unroll
  for (int r = 0; r < MR; ++r) {
    if (r < rows && lane == (r & 31)) st(out[(size_t)(m0 + r) * ldo + out_col + n], acc[r] + bv);
  }
}

// 32 floats to o (rounded to T); vec: 16-byte stores (o 16-byte aligned)
__device__ __forceinline__ u32 bits16(f16 v) { return v.x; }
__device__ __forceinline__ u32 bits16(bf16 v) { return v.x; }
template <typename T>
__device__ __forceinline__ void store32_16(T* o, const float (&w)[32], int vec) {
  if (vec) {
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      u32 p[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        T a, b;
        st(a, w[8 * c + 2 * i]);
        st(b, w[8 * c + 2 * i + 1]);
        p[i] = bits16(a) | (bits16(b) << 16);
      }
      *reinterpret_cast<uint4*>(o + 8 * c) = make_uint4(p[0], p[1], p[2], p[3]);
    }
  } else {
#pragma unroll
    for (int j = 0; j < 32; ++j) st(o[j], w[j]);
  }
}
__device__ __forceinline__ void store32(f16* o, const float (&w)[32], int vec) { store32_16(o, w, vec); }
__device__ __forceinline__ void store32(bf16* o, const float (&w)[32], int vec) { store32_16(o, w, vec); }
__device__ __forceinline__ void store32(float* o, const float (&w)[32], int vec) {
  if (vec) {
#pragma unroll
    for (int c = 0; c < 8; ++c)
      *reinterpret_cast<float4*>(o + 4 * c) = make_float4(w[4 * c], w[4 * c + 1], w[4 * c + 2], w[4 * c + 3]);
  } else {
#pragma unroll
    for (int j = 0; j < 32; ++j) o[j] = w[j];
  }
}

template <int F, typename T>
__global__ void __launch_bounds__(128)
    quant_dequant(const u8* __restrict__ W, long long w_stride, const void* __restrict__ ids, int id_kind,
                  T* __restrict__ out, long long n_out, long long n_rows, int K, int o_vec) {
  const int units = K >> 5;
  for (long long i = blockIdx.x; i < n_out; i += gridDim.x) {
    long long r = i;
    if (id_kind == 1) r = (long long)reinterpret_cast<const int*>(ids)[i];
    else if (id_kind == 2) r = reinterpret_cast<const long long*>(ids)[i];
    r = r < 0 ? 0 : (r >= n_rows ? n_rows - 1 : r);
    const u8* row = W + (size_t)r * (size_t)w_stride;
    T* o = out + (size_t)i * K;
    for (int u = threadIdx.x; u < units; u += blockDim.x) {
      float w[32];
      unit<F>(row, u, w);
      store32(o + 32 * u, w, o_vec);
    }
  }
}
