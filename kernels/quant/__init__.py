"""The quant family: matrices kept in their GGUF block formats, dequantized inside the kernels.

| part             | module               | what                                                          |
|------------------|----------------------|---------------------------------------------------------------|
| op               | :mod:`.op`           | ``qmatmul``, ``dequantize``: signatures, checks, KernelSpecs   |
| plan             | :mod:`._plan`        | formats Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K; the packed device layout (``pack``); row tiles |
| checks           | :mod:`._check`       | formats, packed shapes, dtypes, outputs                       |
| CUDA launcher    | :mod:`._cuda`        | ``quant_gemv.cu`` loading and launches                        |
| reference        | :mod:`._reference`   | float64: ``gguf.quants.dequantize``, then float64 math; random blocks (tests, benchmarks) |
| cpu path         | :mod:`._cpu`         | NumPy dequantization per block (cached), float32 BLAS          |
| sources          | ``quant_formats.cuh``, ``quant_gemv.cu`` | per-unit dequantization; GEMV (M <= 32 a launch), dequantize rows |

Semantics (every backend)::

    qmatmul:    out[m, out_col + n] = sum_k x[m, k] * W[n, k] (+ bias[n])
    dequantize: out[i, k] = W[ids[i], k]   (or out = W without ids)

where ``W`` is the ``(N, K)`` matrix the GGUF blocks encode (exactly ``gguf.quants.dequantize``
of them; products with the fp16 scales formed in float32), ``x`` float32/float16/bfloat16,
accumulation in float32, one rounding to the output dtype.

CUDA: a warp per weight row streams the row's blocks once, each lane dequantizing 32-element
units into registers and multiplying them with up to 32 activation rows; the 32 lanes' sums
are reduced by shuffles. Prefill (many rows) is meant to go through :func:`.op.dequantize`
into a float16 scratch matrix and ``gemm`` (the nn layer does so): ``qmatmul`` with ``M > 32``
is correct but streams the weight once per 32 rows.
"""

from __future__ import annotations

from ._plan import FORMATS, QuantFormat, get_format, pack, packed_words, row_bytes, unpack
from ._reference import dequantize_reference, qmatmul_reference, random_blocks, random_packed
from .op import dequantize, qmatmul

__all__ = ["FORMATS", "QuantFormat", "dequantize", "dequantize_reference", "get_format", "pack",
           "packed_words", "qmatmul", "qmatmul_reference", "random_blocks", "random_packed", "row_bytes",
           "unpack"]
