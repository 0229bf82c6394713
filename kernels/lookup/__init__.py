"""The lookup family: ``embedding`` (row gather) and ``argmax`` (over the last dim).

| part             | module              | what                                                    |
|------------------|---------------------|---------------------------------------------------------|
| op               | :mod:`.op`          | the launchers' public signatures and checks, KernelSpecs|
| CUDA launcher    | :mod:`._cuda`       | ``lookup.cu`` loading and launches                      |
| reference        | :mod:`._reference`  | NumPy (the cpu backend runs it: gathers and argmax are exact) |
| sources          | ``lookup.cu``       |                                                         |
"""

from .op import argmax, embedding

__all__ = ["argmax", "embedding"]
