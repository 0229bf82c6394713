"""Packed prefill (``CausalLM.prefill_many``, :mod:`deviceops.nn.runner.packed_prefill`):
several rows' prompt chunks in one forward pass write the KV and draw the tokens the same
``prefill`` calls do.

cpu backend, an untied random model (a wrong position or KV entry changes the next tokens):
the first tokens, and the tokens of several decode steps after them (which read every KV
entry the prefill wrote), equal those of one ``prefill`` per row, greedy and sampled, for
first chunks and later chunks of a prompt; the checks refuse bad chunks before anything is
enqueued; the serving engine packs the chunks of requests admitted together.
"""

from __future__ import annotations

from typing import Any

import anyio
import numpy as np
import pytest

from deviceops import nn
from deviceops.nn.runner.packed_prefill import MAX_CHUNK

CFG = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
           num_kv_heads=2, head_dim=16, rope_theta=1e4, tie_word_embeddings=False)


def _model(**kw: Any) -> Any:
    args = {"max_batch": 4, "max_seq": 96, "kv_block_size": 8, "kv_blocks": 60,
            "prefill_chunk": 64} | kw
    return nn.random_model(nn.LlamaConfig(**CFG), dtype="float32", device="cpu", seed=4, **args)


def _read(m: Any, view: Any) -> list[int]:
    return [int(x) for x in np.asarray(m.read(view).sync_on(m.device_stream))]


def _after(m: Any, firsts: dict[int, int], pos: dict[int, int], steps: int = 4) -> list[list[int]]:
    """Decode ``steps`` tokens for the rows from their first tokens (fed from the host)."""
    slots = sorted(firsts)
    last = [firsts[s] for s in slots]
    out = []
    for k in range(steps):
        view = m.decode_step(slots, last, [pos[s] + k for s in slots], graph=False)
        got = _read(m, view)
        last = [got[s] for s in slots]
        out.append(last)
    return out


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_packed_prefill_writes_and_draws_what_single_prefills_do(temperature: float) -> None:
    rng = np.random.default_rng(5)
    prompts = {0: rng.integers(3, 96, 7).tolist(), 1: rng.integers(3, 96, 21).tolist(),
               3: rng.integers(3, 96, 30).tolist()}
    results = []
    for packed in (False, True):
        m = _model()
        for s in prompts:  # (row 1 with top-k: the packed draw reads each row's own)
            m.set_sampling(s, temperature=temperature, seed=11 + s, top_k=5 if s == 1 else 0)
        # row 3's prompt in two chunks: its first 12 tokens alone, the rest packed with others
        m.prefill(3, prompts[3][:12], 0, sample=False)
        chunks = [(0, prompts[0], 0, True), (1, prompts[1], 0, True), (3, prompts[3][12:], 12, True)]
        if packed:
            view = m.prefill_many(chunks)
            firsts = {s: _read(m, view)[s] for s in prompts}
        else:
            firsts = {}
            for slot, ids, start, _ in chunks:
                firsts[slot] = _read(m, m.prefill(slot, ids, start, sample=True))[0]
        after = _after(m, firsts, {s: len(p) for s, p in prompts.items()})
        results.append((firsts, after))
    assert results[0] == results[1]


def test_packed_prefill_feeds_decode_from_the_device() -> None:
    m = _model()
    rng = np.random.default_rng(2)
    ps = [rng.integers(3, 96, n).tolist() for n in (5, 17)]
    m.prefill_many([(0, ps[0], 0, True), (2, ps[1], 0, True)])
    view = m.decode_step([0, 2], None, [5, 17], graph=False)  # the packed draws, never read
    ref = _model()
    a = _read(ref, ref.prefill(0, ps[0], 0, sample=True))[0]
    b = _read(ref, ref.prefill(2, ps[1], 0, sample=True))[0]
    want = _read(ref, ref.decode_step([0, 2], [a, b], [5, 17], graph=False))
    got = _read(m, view)
    assert [got[0], got[2]] == [want[0], want[2]]


def test_prefill_many_refuses_bad_chunks_before_enqueueing() -> None:
    m = _model()
    with pytest.raises(ValueError, match="repeat a row"):
        m.prefill_many([(0, [5, 6], 0, True), (0, [7], 2, True)])
    with pytest.raises(ValueError, match=f"at most {MAX_CHUNK}"):
        _model(max_seq=256, prefill_chunk=256).prefill_many([(0, [5] * (MAX_CHUNK + 1), 0, True)])
    with pytest.raises(ValueError, match="exceed prefill_chunk=64"):
        m.prefill_many([(0, [5] * 40, 0, True), (1, [5] * 40, 0, True)])
    with pytest.raises(ValueError, match="do not fit max_seq"):
        m.prefill_many([(0, [5] * 10, 90, True)])
    with pytest.raises(ValueError, match="no chunks"):
        m.prefill_many([])
    m.set_sampling(1, logprobs=True)
    with pytest.raises(ValueError, match="sampling features"):
        m.prefill_many([(1, [5, 6], 0, True)])
    assert all(m.blocks_held(i) == 0 for i in range(4))  # nothing was written


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_engine_packs_the_chunks_of_requests_admitted_together(prefix_cache: bool) -> None:
    """Requests admitted in one step: the short chunks of rows without features go into one
    packed prefill (counted), a long chunk and a row asking for log-probabilities go through
    ``prefill`` in their turn, and every output (log-probabilities too) equals the engine's
    with packing off (the step model without ``submit_prefills``); one request alone is
    never packed."""
    from deviceops.nn import Engine
    from deviceops.nn.serving.step_model import CausalLMSteps

    rng = np.random.default_rng(8)
    ps = [rng.integers(3, 96, n).tolist() for n in (6, 19, 150, 11, 27)]  # 150: not packed
    lp_row = 3  # asks for log-probabilities: not packed

    raised: list[BaseException] = []

    def run(pack: bool, which: list[int]) -> tuple[list[Any], int]:
        m = _model(max_seq=256, prefill_chunk=256, kv_blocks=200)
        calls = {"n": 0}
        real = m.prefill_many

        def counting(*a: Any, **k: Any) -> Any:
            calls["n"] += 1
            return real(*a, **k)

        m.prefill_many = counting
        steps = CausalLMSteps(m)
        if not pack:
            steps.submit_prefills = None  # type: ignore[assignment]
        else:  # a packed call that raised would be retried chunk by chunk: none may raise
            real_many = steps.submit_prefills

            def checked(*a: Any, **k: Any) -> Any:
                try:
                    return real_many(*a, **k)
                except Exception as exc:
                    raised.append(exc)
                    raise

            steps.submit_prefills = checked  # type: ignore[method-assign]
        eng = Engine(steps, max_batch=4, max_seq=256, prefill_chunk=256,
                     prefix_cache=prefix_cache)

        async def main() -> list[Any]:
            out: list[Any] = [None] * len(ps)
            streams = {i: eng.stream(ps[i], 6, temperature=1.0, seed=i,
                                     logprobs=2 if i == lp_row else None)
                       for i in which}  # all queued before the first step: admitted together

            async def one(i: int) -> None:
                s = streams[i]
                toks = [t async for t in s]
                out[i] = (toks, [round(x.logprob, 4) for x in s.logprobs] if i == lp_row else None)

            async with anyio.create_task_group() as tg:
                for i in which:
                    tg.start_soon(one, i)
            return out

        return anyio.run(main), calls["n"]

    every = list(range(len(ps)))
    packed, n_packed = run(True, every)
    plain, n_plain = run(False, every)
    assert packed == plain and packed[lp_row][1]
    assert n_packed >= 1 and n_plain == 0
    alone, n_alone = run(True, [1])
    assert alone[1] == packed[1] and n_alone == 0
    assert not raised  # (else the outputs above came from the chunk-by-chunk retry)


@pytest.mark.gpu
@pytest.mark.parametrize("graph", [False, True])
def test_packed_prefill_on_cuda_matches_single_prefills(graph: bool) -> None:
    """On CUDA (float32, SmolLM2's head shape, the graph and the eager path): the packed
    draws and the decode steps after them equal one ``prefill`` per row."""
    import deviceops

    if not deviceops.cuda_available():
        pytest.skip("needs a CUDA GPU")
    cfg = nn.LlamaConfig(vocab_size=2048, hidden_size=576, intermediate_size=1536, num_layers=4,
                         num_heads=9, num_kv_heads=3, head_dim=64, rope_theta=1e5,
                         tie_word_embeddings=False)
    rng = np.random.default_rng(9)
    prompts = {0: rng.integers(1, 2048, 9).tolist(), 2: rng.integers(1, 2048, 70).tolist(),
               5: rng.integers(1, 2048, 33).tolist()}
    results = []
    for packed in (False, True):
        m = nn.random_model(cfg, dtype="float32", device=0, seed=2, max_batch=8, max_seq=256,
                            prefill_chunk=128, kv_block_size=16, kv_blocks=80)
        for s in prompts:
            m.set_sampling(s, temperature=1.0, seed=5 + s)
        if packed:
            view = m.prefill_many([(s, p, 0, True) for s, p in prompts.items()], graph=graph)
            firsts = {s: _read(m, view)[s] for s in prompts}
        else:
            firsts = {s: _read(m, m.prefill(s, p, 0, sample=True, graph=graph))[0]
                      for s, p in prompts.items()}
        results.append((firsts, _after(m, firsts, {s: len(p) for s, p in prompts.items()})))
    assert results[0] == results[1]


def test_packed_graphs_one_per_padded_length_replay_what_eager_runs() -> None:
    """``capture_graphs`` captures one packed graph per padded length (16 .. prefill_chunk);
    replaying them (the cpu backend records graphs too) draws what the eager ops draw."""
    rng = np.random.default_rng(12)
    prompts = {0: rng.integers(3, 96, 9).tolist(), 1: rng.integers(3, 96, 30).tolist()}
    got = []
    for graph in (False, True):
        m = _model()
        if graph:
            m.capture_graphs(graph=True)
            assert set(m.runner.packer.graphs) == {16, 32, 64}
            assert m.runner.packer.lengths() == [16, 32, 64]
        for s in prompts:
            m.set_sampling(s, temperature=1.0, seed=3 + s)
        view = m.prefill_many([(s, p, 0, True) for s, p in prompts.items()], graph=graph)
        if graph:  # 39 tokens replayed the 64-token graph: no other length was made
            assert set(m.runner.packer.graphs) == {16, 32, 64}
            assert m.runner.packer.pad_len(39) == 64 and m.runner.packer.pad_len(17) == 32
        firsts = {s: _read(m, view)[s] for s in prompts}
        got.append((firsts, _after(m, firsts, {s: len(p) for s, p in prompts.items()})))
    assert got[0] == got[1]


def test_a_chunk_that_samples_nothing_leaves_nothing_to_feed() -> None:
    m = _model()
    m.prefill_many([(0, [5, 6, 7], 0, True), (1, [8, 9], 0, False)])
    for pos in (0, 2):
        with pytest.raises(ValueError, match=r"rows \[1\] do neither"):
            m.decode_step([1], None, [pos], graph=False)
    m.decode_step([0], None, [3], graph=False)  # the sampling chunk's row: fed


def test_worth_packing_takes_short_chunks_wherever_they_start() -> None:
    from deviceops.nn.runner.packed_prefill import worth_packing

    assert worth_packing(0, 1) and worth_packing(0, 96) and worth_packing(0, MAX_CHUNK)
    assert worth_packing(992, 72)  # a suffix after a cached prefix (measured: packed wins)
    assert not worth_packing(0, MAX_CHUNK + 1) and not worth_packing(500, MAX_CHUNK + 1)


def test_capture_graphs_shows_a_named_bar_for_the_warm_ups_and_one_for_the_captures(
        capsys: pytest.CaptureFixture[str]) -> None:
    m = _model()
    n = m.capture_graphs(graph=True, progress=True)
    err = capsys.readouterr().err
    assert "compiling kernels (warm-up runs)" in err and "capturing CUDA graphs" in err
    assert n == len(m.runner.decoder.graphs) + len(m.runner.prefiller.graphs) + len(
        m.runner.packer.graphs)
    quiet = _model()
    quiet.capture_graphs(graph=True)
    assert "capturing" not in capsys.readouterr().err  # no bar unless asked
