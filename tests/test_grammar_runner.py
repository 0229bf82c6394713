"""Grammar masks in the runner's step API (``set_sampling(grammar=True)``, ``set_mask``,
``decode_step(masks=...)``), on the cpu backend with a small random model (odd vocabulary).

Constrained rows (0 and 2, their masks uploaded as one block with row 1 between them) draw
only allowed tokens, from their prefill's first token on, through the split feature step
(the forward graph, the masks asked for, the sampling graph) and eagerly alike; the
unconstrained row between them draws exactly what it draws without them.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from deviceops import nn

CFG = dict(vocab_size=77, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=2,
           num_kv_heads=1, head_dim=16, rope_theta=1e4, tie_word_embeddings=False)
PROMPTS = [[3, 9, 4, 1], [5, 6], [8, 8, 2, 7, 30]]


def _bits(allowed: np.ndarray) -> np.ndarray:
    """Boolean ``(rows, V)`` as llguidance's int32 bitmask ``(rows, ceil(V / 32))``."""
    r, v = allowed.shape
    w = -(-v // 32)
    bits = np.zeros((r, w * 32), bool)
    bits[:, :v] = allowed
    return np.packbits(bits.reshape(r, w, 4, 8), axis=-1, bitorder="little").reshape(
        r, w * 4).view("<i4").astype(np.int32)


def _run(constrain: bool, graph: bool, steps: int = 6, device: str = "cpu",
         begin: bool = False) -> tuple[list[list[int]], list[Any]]:
    m = nn.random_model(nn.LlamaConfig(**CFG), dtype="float32", device=device, seed=2,
                        max_batch=4, max_seq=32)
    rng = np.random.default_rng(9)
    # rows 0 and 2 constrained (row 1 between them is not): a few tokens per draw
    allowed = [rng.random((2, 77)) < 0.06 for _ in range(steps + 1)]
    for a in allowed:
        a[:, rng.integers(0, 77)] = True
    for slot, (t, seed) in enumerate([(1.0, 4), (0.0, 0), (0.8, 7)]):
        m.set_sampling(slot, temperature=t, seed=seed, grammar=constrain and slot != 1)
    if constrain:
        m.set_mask([2, 0], _bits(allowed[0][::-1]))
    toks = [[int(m.read(m.prefill(s, p)).sync_on(m.device_stream)[0])]
            for s, p in enumerate(PROMPTS)]
    asked: list[Any] = []
    for k in range(steps):
        def masks(k: int = k) -> tuple[list[int], np.ndarray]:
            asked.append(k)
            return [0, 2], _bits(allowed[k + 1])

        args = ([0, 1, 2], [t[-1] for t in toks], [len(p) + k for p in PROMPTS])
        if begin:  # the forward pass now, the masks and the sampling when finished
            view, finish = m.decode_begin(*args, masks, graph=graph)
            assert asked == list(range(k))  # not asked yet
            finish()
        else:
            view = m.decode_step(*args, graph=graph, masks=masks if constrain else None)
        host = m.read(view).sync_on(m.device_stream)
        for s in range(3):
            toks[s].append(int(host[s]))
    if constrain:
        for k in range(steps + 1):
            assert allowed[k][0, toks[0][k]] and allowed[k][1, toks[2][k]], k
        dec = m.runner.decoder
        assert bool(dec.split_graphs) == graph and not dec.feature_graphs
    return toks, asked


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_masked_row_draws_allowed_tokens_and_leaves_the_others_alone(device: str) -> None:
    free, _ = _run(False, True, device=device)
    got = {}
    for graph in (True, False):
        shaped, asked = _run(True, graph, device=device)
        assert asked == list(range(6))  # once per step
        assert shaped[1] == free[1], graph  # the row between them: the same tokens
        assert shaped[0] != free[0] and shaped[2] != free[2]  # (the masks changed something)
        got[graph] = shaped
    assert got[True] == got[False]  # graphs and eager agree
    for graph in (True, False):  # decode_begin + finish: the same draws
        assert _run(True, graph, device=device, begin=True)[0] == got[True]
