"""The transformer family: ``rope``, ``rope_kv_write``, ``merge_heads``, ``split_qkv`` and
``qk_rms_norm``.

| part             | module              | what                                                    |
|------------------|---------------------|---------------------------------------------------------|
| op               | :mod:`.op`          | the launchers' public signatures, their KernelSpecs     |
| checks           | :mod:`._check`      | positions (``start``), ``theta``, a paged block table   |
| CUDA launcher    | :mod:`._cuda`       | ``transformer.cu`` loading                              |
| reference        | :mod:`._reference`  | float64 NumPy oracles                                   |
| cpu fast path    | :mod:`._cpu`        | float32 RoPE                                            |
| sources          | ``transformer.cu``  |                                                         |
"""

from .op import merge_heads, qk_rms_norm, rope, rope_kv_write, split_qkv

__all__ = ["merge_heads", "qk_rms_norm", "rope", "rope_kv_write", "split_qkv"]
