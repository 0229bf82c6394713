"""The sampling family: ``sample`` (temperature, top-k, top-p, a counter-based device RNG),
``penalize`` (presence/frequency penalties, logit bias), ``mask_logits`` (a grammar's
allowed-token bitmask) and ``logprobs`` (the sampled token's
log-probability and the top-k).

| part             | module              | what                                                    |
|------------------|---------------------|---------------------------------------------------------|
| op               | :mod:`.op`          | ``sample``: public signature and checks, the KernelSpec |
| CUDA launcher    | :mod:`._cuda`       | ``sampling.cu`` loading and launch                      |
| reference        | :mod:`._reference`  | float64 NumPy oracles (the cpu backend's sample), the RNG |
| cpu              | :mod:`._cpu`        | float32 paths of ``penalize``, ``mask_logits``, ``logprobs`` |
| sources          | ``sampling.cu``, ``logits.cu`` |                                              |
"""

from ._reference import (
    logprobs_reference,
    mask_logits_reference,
    penalize_reference,
    sample_reference,
    uniform,
)
from .op import MASK_BIT, MAX_TOP, logprobs, mask_logits, penalize, sample

__all__ = ["MASK_BIT", "MAX_TOP", "logprobs", "logprobs_reference", "mask_logits",
           "mask_logits_reference", "penalize", "penalize_reference", "sample",
           "sample_reference", "uniform"]
