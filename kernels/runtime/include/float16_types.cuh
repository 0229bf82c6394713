// 16-bit float storage types and their float32 conversions, shared by the flat kernels
// (elementwise.cu and rows.cuh, so every row-wise kernel). Plain structs converted with PTX `cvt`, so
// NVRTC needs no cuda_fp16.h / cuda_bf16.h. Inlined by kernels/runtime/_module.expanded_source.

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

