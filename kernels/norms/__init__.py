"""The norms family: ``rms_norm``, ``add_rms_norm`` and ``layer_norm`` over the last dim.

| part             | module              | what                                                    |
|------------------|---------------------|---------------------------------------------------------|
| op               | :mod:`.op`          | the launchers' public signatures, their KernelSpecs     |
| checks           | :mod:`._check`      | weight/bias vectors, ``eps``                            |
| CUDA launcher    | :mod:`._cuda`       | ``norms.cu`` loading, the rms_norm launch plan          |
| reference        | :mod:`._reference`  | float64 NumPy oracles                                   |
| cpu fast path    | :mod:`._cpu`        | float32 NumPy                                           |
| sources          | ``norms.cu``        | ``layer_norm``, ``add_rms_norm`` (also plain rms_norm)  |

No plan module: the geometry is chosen per launch (:func:`._cuda.norm_geometry`).
"""

from .op import add_rms_norm, layer_norm, rms_norm

__all__ = ["add_rms_norm", "layer_norm", "rms_norm"]
