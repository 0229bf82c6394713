"""A prefill chunk graph that cannot be captured is said (RuntimeWarning), not silent; the
chunk then runs eagerly with the same result (cpu backend, a tiny random model)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import deviceops
from deviceops import nn
from deviceops.nn.models import LlamaConfig

TINY = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=2,
                   num_heads=4, num_kv_heads=2, head_dim=8)


def _tokens(m: Any, ids: list[int], graph: bool) -> int:
    m.set_sampling(0)
    view = m.prefill(0, ids, graph=graph)
    out = m.read(view).sync_on(m.device_stream)
    m.release(0)
    return int(np.asarray(out).ravel()[0])


def test_refused_prefill_capture_warns_and_runs_eagerly(monkeypatch: pytest.MonkeyPatch) -> None:
    m = nn.random_model(TINY, device="cpu", max_batch=2, max_seq=128, prefill_chunk=32)
    ids = [int(i) for i in np.random.default_rng(1).integers(3, 120, 20)]
    want = _tokens(m, ids, graph=False)

    def refuse(self: Any, stream: Any) -> Any:
        self._consume()
        raise deviceops.CaptureError("refused for the test", op="test")

    monkeypatch.setattr(deviceops.DeviceOp, "graph_on", refuse)
    with pytest.warns(RuntimeWarning, match="could not be captured"):
        got = _tokens(m, ids, graph=True)
    assert got == want
    assert any(g is None for g in m.runner.prefiller.graphs.values())
