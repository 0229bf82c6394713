"""The elementwise family: ``saxpy``, ``add``, ``mul`` and the activations ``softmax``,
``gelu``, ``silu``, ``swiglu``, ``geglu``.

| part             | module              | what                                                    |
|------------------|---------------------|---------------------------------------------------------|
| op               | :mod:`.op`          | the launchers' public signatures (the op classes)       |
| checks           | :mod:`._check`      | matching operands, ``saxpy``'s scalar                   |
| plan             | :mod:`._plan`       | the last launch of ``saxpy``/``add``/``mul`` (plan cache) |
| CUDA launcher    | :mod:`._cuda`       | kernel loading, launch geometry, driver launches        |
| reference        | :mod:`._reference`  | float64 NumPy oracles of the activations                |
| cpu fast path    | :mod:`._cpu`        | NumPy tasks (float32 math for 16-bit dtypes)            |
| sources          | ``elementwise.cu``, ``activations.cu`` |                              |
"""

from .op import add, geglu, gelu, mul, saxpy, silu, softmax, swiglu

__all__ = ["add", "geglu", "gelu", "mul", "saxpy", "silu", "softmax", "swiglu"]
