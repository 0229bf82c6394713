"""The sampling family: ``sample`` (temperature, top-k, top-p, a counter-based device RNG).

| part             | module              | what                                                    |
|------------------|---------------------|---------------------------------------------------------|
| op               | :mod:`.op`          | ``sample``: public signature and checks, the KernelSpec |
| CUDA launcher    | :mod:`._cuda`       | ``sampling.cu`` loading and launch                      |
| reference        | :mod:`._reference`  | float64 NumPy oracle (the cpu backend runs it), the RNG |
| sources          | ``sampling.cu``     |                                                         |
"""

from ._reference import sample_reference, uniform
from .op import sample

__all__ = ["sample", "sample_reference", "uniform"]
