"""deviceops.nn on a tiny random Llama (GGUF written by the test): model, generation, sampling.

cpu backend, float32: logits against a float64 NumPy Llama; greedy tokens against that
reference; batch == alone; graph replay == eager; chunked prefill; the step API with idle
and reused rows; stop ids; stream under asyncio and trio; seeded sampling reproducible and
distributed as the contract says (chi-square).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from deviceops import api

from . import nn_tiny


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, dict[str, np.ndarray]]:
    from deviceops import nn

    path = Path(tmp_path_factory.mktemp("tiny")) / "tiny.gguf"
    held = nn_tiny.write_gguf(path, nn_tiny.hf_weights(1, tied=False), "Q8_0")
    m = nn.load_gguf(path, device="cpu", dtype="float32", max_batch=8, max_seq=64, prefill_chunk=64)
    return m, held


def host(m: Any, t: Any) -> np.ndarray:
    return np.asarray(api.to_host(t).sync_on(m.device_stream))


ref_greedy = nn_tiny.reference_greedy


PROMPTS = ["the cat sat", "in the beginning", "a", "then on and on the theme went"]


def test_logits_match_reference(tiny: Any) -> None:
    m, held = tiny
    for text in PROMPTS:
        ids = m.encode(text)
        got = host(m, m.logits(ids).sync_on(m.device_stream))
        ref = nn_tiny.reference_logits(held, ids)
        assert got.shape == (len(ids), m.config.vocab_size)
        err = np.abs(got - ref).max() / np.abs(ref).max()
        assert err < 1e-5, f"{text!r}: logits differ from the float64 reference by {err:.2e}"


def test_greedy_matches_reference(tiny: Any) -> None:
    m, held = tiny
    for text in PROMPTS[:2]:
        ids = m.encode(text)
        assert m.generate(ids, 6) == ref_greedy(held, ids, 6)


def test_batch_equals_alone_greedy_and_sampled(tiny: Any) -> None:
    m, _ = tiny
    ids = [m.encode(t) for t in PROMPTS]
    assert len({len(i) for i in ids}) > 1  # different lengths
    for kw in ({}, {"temperature": 1.0, "top_k": 20, "seed": 7}):
        batch = m.generate(ids, 8, **kw)
        alone = [m.generate(i, 8, **kw) for i in ids]
        assert batch == alone, kw
    assert m.generate(PROMPTS, 3) == [m.generate(t, 3) for t in PROMPTS]  # str prompts


def test_graph_replay_equals_eager(tiny: Any) -> None:
    m, _ = tiny
    ids = [m.encode(t) for t in PROMPTS[:3]]
    for kw in ({}, {"temperature": 0.9, "top_p": 0.9, "seed": 3}):
        assert m.generate(ids, 10, graph=True, **kw) == m.generate(ids, 10, graph=False, **kw)


def test_graph_prefill_padded_chunks_equal_eager(tmp_path: Path) -> None:
    """Prefill graphs (chunks padded to 16, 32; one per length, any row) == eager prefill."""
    from deviceops import nn

    path = tmp_path / "t.gguf"
    held = nn_tiny.write_gguf(path, nn_tiny.hf_weights(1, tied=False), "Q8_0")
    m = nn.load_gguf(path, device="cpu", max_batch=4, max_seq=48, prefill_chunk=32)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, m.config.vocab_size, n).tolist() for n in (5, 16, 21, 40, 45)]
    for kw in ({}, {"temperature": 1.0, "seed": 2}):
        g = m.generate(prompts[:4], 3, graph=True, **kw)
        assert m.generate(prompts[:4], 3, graph=False, **kw) == g
    # one graph per padded length and chunk kind (at position 0 or later), shared by the rows
    assert set(m.runner.prefiller.graphs) == {(16, True), (32, True), (16, False)}
    # 45 tokens: chunk 32 (graph) + 13 padded to 16 (positions 45..47 in the row's last block)
    assert m.generate(prompts[4], 3, graph=True) == ref_greedy(held, prompts[4], 3)
    s = m.device_stream
    m.set_sampling(3)
    tok = m.read(m.prefill(3, prompts[2], graph=True)).sync_on(s)  # replays a captured graph
    assert int(tok[0]) == ref_greedy(held, prompts[2], 1)[0]


def test_chunked_prefill_equals_one_chunk(tiny: Any, tmp_path: Path) -> None:
    from deviceops import nn

    m, _ = tiny
    path = tmp_path / "t.gguf"
    nn_tiny.write_gguf(path, nn_tiny.hf_weights(1, tied=False), "Q8_0")
    small = nn.load_gguf(path, device="cpu", max_batch=2, max_seq=64, prefill_chunk=5)
    ids = m.encode(PROMPTS[3])
    assert len(ids) > 2 * 5
    a = host(small, small.logits(ids).sync_on(small.device_stream))
    b = host(m, m.logits(ids).sync_on(m.device_stream))
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    assert small.generate(ids, 6) == m.generate(ids, 6)


def test_step_api_idle_rows_and_reuse(tiny: Any) -> None:
    """Rows 5 and 2 decode while rows 0,1,3,4 of bucket 8 stay idle; slot 5 is then reused."""
    m, held = tiny
    s = m.device_stream
    a, b = m.encode(PROMPTS[0]), m.encode(PROMPTS[1])
    want_a, want_b = ref_greedy(held, a, 5), ref_greedy(held, b, 4)
    for slot in (5, 2):
        m.set_sampling(slot)
    ta = int(m.read(m.prefill(5, a)).sync_on(s)[0])
    tb = int(m.read(m.prefill(2, b)).sync_on(s)[0])
    got_a, got_b = [ta], [tb]
    for step in range(3):
        view = m.decode_step([5, 2], [got_a[-1], got_b[-1]], [len(a) + step, len(b) + step])
        h = m.read(view).sync_on(s)
        assert view.shape == (8,)
        got_a.append(int(h[5]))
        got_b.append(int(h[2]))
    m.release(2)
    view = m.decode_step([5], [got_a[-1]], [len(a) + 3])  # row 2 idle now
    got_a.append(int(m.read(view).sync_on(s)[5]))
    assert got_a == want_a and got_b == want_b
    m.release(5)
    m.set_sampling(5)  # reuse slot 5 for another prompt
    assert int(m.read(m.prefill(5, b)).sync_on(s)[0]) == want_b[0]


def test_step_api_errors(tiny: Any) -> None:
    m, _ = tiny
    with pytest.raises(ValueError, match="slot"):
        m.prefill(8, [1, 2])
    with pytest.raises(ValueError, match="max_seq"):
        m.prefill(0, [5] * 10, start=60)
    with pytest.raises(ValueError, match="token id"):
        m.prefill(0, [m.config.vocab_size])
    with pytest.raises(ValueError, match="repeat"):
        m.decode_step([1, 1], [5, 5], [3, 3])
    with pytest.raises(ValueError, match="position"):
        m.decode_step([1], [5], [64])
    with pytest.raises(ValueError, match="equal length"):
        m.decode_step([1], [5, 6], [3])


def test_stop_eos_and_limits(tiny: Any) -> None:
    m, _ = tiny
    ids = m.encode(PROMPTS[1])
    full = m.generate(ids, 6)
    assert m.generate(ids, 0) == []
    stop = full[2]
    k = full.index(stop)
    assert m.generate(ids, 6, stop=[stop]) == full[: k + 1]
    # a row ends when its cache row is full (max_seq=64)
    long = [5] * 60
    assert len(m.generate(long, 20)) == 64 - 60 + 1
    with pytest.raises(ValueError, match="max_seq"):
        m.generate([5] * 65, 2)
    with pytest.raises(ValueError, match="temperature"):
        m.generate(ids, 2, temperature=-1.0)
    with pytest.raises(ValueError, match="top_p"):
        m.generate(ids, 2, top_p=0.0)
    with pytest.raises(TypeError, match="prompt"):
        m.generate(3.5, 2)


@pytest.mark.anyio
async def test_stream_equals_generate(tiny: Any) -> None:
    m, _ = tiny
    ids = m.encode(PROMPTS[0])
    want = m.generate(ids, 7, temperature=0.8, seed=11)
    got = [t async for t in m.stream(ids, 7, temperature=0.8, seed=11)]
    assert got == want
    with pytest.raises(TypeError, match="one prompt"):
        async for _ in m.stream([ids, ids], 2):
            pass


def test_seeded_sampling_reproducible(tiny: Any) -> None:
    m, _ = tiny
    ids = m.encode(PROMPTS[2])
    kw: dict[str, Any] = {"temperature": 1.5, "top_k": 0, "top_p": 1.0}
    a = m.generate(ids, 12, seed=5, **kw)
    assert a == m.generate(ids, 12, seed=5, **kw)
    assert a != m.generate(ids, 12, seed=6, **kw)


def expected_probs(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """The contract's distribution: softmax(l / T) on the top-k set, then the top-p prefix."""
    z = logits.astype(np.float64) / temperature
    order = np.argsort(-z, kind="stable")
    keep = np.zeros(z.shape, bool)
    keep[order[: top_k or len(z)]] = True
    p = np.where(keep, np.exp(z - z.max()), 0.0)
    p /= p.sum()
    cum = np.cumsum(p[order])
    n = int(np.searchsorted(cum, top_p - 1e-12) + 1)
    final = np.zeros_like(p)
    final[order[:n]] = p[order[:n]]
    return final / final.sum()


def test_sampling_distribution_chi_square(tiny: Any) -> None:
    """First-token draws over many seeds follow the top-k/top-p softmax (chi-square, p=0.001)."""
    m, _ = tiny
    s = m.device_stream
    ids = m.encode("on the")
    t, k, p = 2.0, 6, 0.9
    logits = host(m, m.logits(ids).sync_on(s))[-1]
    probs = expected_probs(logits, t, k, p)
    support = np.flatnonzero(probs)
    assert 2 <= len(support) <= k
    n = 400
    counts: dict[int, int] = {}
    rows = m.max_batch
    for base in range(0, n, rows):
        for r in range(rows):
            m.set_sampling(r, temperature=t, top_k=k, top_p=p, seed=1000 + base + r)
            m.prefill(r, ids)
        h = m.read(m.runner.rows.tokens[:rows]).sync_on(s)
        for r in range(rows):
            counts[int(h[r])] = counts.get(int(h[r]), 0) + 1
    assert set(counts) <= set(support.tolist()), f"drew tokens outside the top-k/top-p set: {counts}"
    obs = np.array([counts.get(int(i), 0) for i in support], np.float64)
    exp = probs[support] * n
    chi2 = float(((obs - exp) ** 2 / exp).sum())
    crit = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52}[len(support) - 1]
    assert chi2 < crit, f"chi-square {chi2:.1f} >= {crit} (df {len(support) - 1}): {obs} vs {exp}"
