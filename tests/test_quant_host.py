"""The CUDA dequantization code (``kernels/quant/quant_formats.cuh``) compiled for the host
with g++ and run on fresh random blocks of every format: equal to the NumPy path (and so to
``gguf.quants.dequantize``) up to an fma's rounding, with every load at the alignment its CUDA
width needs (2, 4 or 16 bytes) given 16-byte aligned rows. This checks the bit arithmetic of
the GPU kernels on machines without a GPU; the GPU tests (``test_quant_gpu.py``) check the
kernels themselves. Skipped without a C++ compiler."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from deviceops.kernels import quant
from deviceops.kernels.quant._cpu import dequantize_blocks

from .quant_blocks import ALL_FORMATS, random_blocks

SOURCE = Path(quant.__file__).resolve().parent / "quant_formats.cuh"
CODE = {"Q4_0": 0, "Q4_1": 1, "Q5_0": 2, "Q8_0": 3, "Q4_K": 4, "Q6_K": 5}

HARNESS = r"""
#define QUANT_HOST 1
#define __device__
#define __forceinline__ inline
#define __restrict__ __restrict
#include <cmath>
#include <cstdint>
#include <cstring>
struct uint4 { unsigned x, y, z, w; };
static int misaligned = 0;
template <class T> inline T __ldg(const T* p) {
  if (reinterpret_cast<std::uintptr_t>(p) % sizeof(T)) misaligned++;
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}
float half_bits(unsigned h) {
  unsigned s = (h >> 15) & 1u, e = (h >> 10) & 31u, m = h & 1023u;
  float v = e == 0 ? std::ldexp((float)m, -24)
          : e == 31 ? (m ? NAN : INFINITY) : std::ldexp((float)(m | 1024u), (int)e - 25);
  return s ? -v : v;
}
#include "quant_formats.cuh"
template <int F> static void rows(const u8* w, long long stride, int n, int k, float* out) {
  for (int r = 0; r < n; ++r)
    for (int u = 0; u < k / 32; ++u) {
      float v[32];
      unit<F>(w + r * stride, u, v);
      for (int j = 0; j < 32; ++j) out[(long long)r * k + 32 * u + j] = v[j];
    }
}
extern "C" int deq_rows(int fmt, const unsigned char* w, long long stride, int n, int k, float* out) {
  misaligned = 0;
  switch (fmt) {
    case 0: rows<0>(w, stride, n, k, out); break;
    case 1: rows<1>(w, stride, n, k, out); break;
    case 2: rows<2>(w, stride, n, k, out); break;
    case 3: rows<3>(w, stride, n, k, out); break;
    case 4: rows<4>(w, stride, n, k, out); break;
    case 5: rows<5>(w, stride, n, k, out); break;
  }
  return misaligned;
}
"""


@pytest.fixture(scope="module")
def lib(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    cxx = shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no C++ compiler (g++, c++ or clang++) on PATH")
    d = tmp_path_factory.mktemp("quant_host")
    (d / "h.cpp").write_text(HARNESS)
    shutil.copy(SOURCE, d / "quant_formats.cuh")
    so = d / "h.so"
    subprocess.run([cxx, "-O1", "-std=c++17", "-shared", "-fPIC", "-Wno-unknown-pragmas",
                    "-ffp-contract=off", "-o", str(so), str(d / "h.cpp")], check=True, cwd=d)
    return ctypes.CDLL(str(so))


@pytest.mark.parametrize("fmt", ALL_FORMATS)
@pytest.mark.parametrize("quantize", [True, False])
def test_cuda_dequant_code_on_host(lib: ctypes.CDLL, fmt: str, quantize: bool) -> None:
    rng = np.random.default_rng(CODE[fmt] + 10 * quantize)
    f = quant.get_format(fmt)
    n, k = 9, 3 * max(f.block, 96)
    blocks = random_blocks(rng, fmt, n, k, quantize=quantize)
    packed = quant.pack(blocks, fmt)
    buf = np.zeros(packed.nbytes + 16, np.uint8)  # a 16-byte aligned copy, as device memory is
    off = (-buf.ctypes.data) % 16
    dev = buf[off:off + packed.nbytes]
    dev[:] = packed.view(np.uint8).reshape(-1)
    out = np.full((n, k), np.nan, np.float32)
    bad = lib.deq_rows(CODE[fmt], dev.ctypes.data_as(ctypes.c_void_p), ctypes.c_longlong(packed.strides[0]),
                       n, k, out.ctypes.data_as(ctypes.c_void_p))
    assert bad == 0, f"{fmt}: {bad} loads at addresses not aligned to their width"
    want = dequantize_blocks(blocks, f)
    np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-6 * float(np.abs(want).max()))
