"""Decode steps enqueued ahead of the host (``generate`` / ``stream`` and
``decode_step(tokens=None)``), on the cpu backend (where the static batch queues ahead only
with ``static_batch.AHEAD_ON_CPU``: both loops are run).

The static batch enqueues step k + 1 before it reads step k's tokens: rows feed what the
last step sampled, still on the device. Checked here: ``tokens=None`` continues exactly as
passing the tokens does (and a prefill's sampled token is fed as the read one is), and is
refused for a row whose token is not on the device for its position; a batch whose rows
stop at different steps (a stop id, ``max_new_tokens``, ``max_seq``) returns row for row what
each prompt returns alone, streams the same tokens, and gives every block back.
"""

from __future__ import annotations

from typing import Any

import anyio
import numpy as np
import pytest

from deviceops import api, nn
from deviceops.nn import static_batch


@pytest.fixture(autouse=True, params=["ahead", "read each step"])
def _ahead(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both loops of the static batch on the cpu backend: the one CUDA runs (the next step
    queued ahead) and the cpu backend's default (each step read first)."""
    monkeypatch.setattr(static_batch, "AHEAD_ON_CPU", request.param == "ahead")

# (an untied head: with the embedding as the head, a random model's next token hardly depends
# on the context, and a wrong position or KV entry would go unseen)
CFG = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
           num_kv_heads=2, head_dim=16, rope_theta=1e4, tie_word_embeddings=False)


def _model(**kw: Any) -> Any:
    args = {"max_batch": 4, "max_seq": 64, "kv_block_size": 16, "kv_blocks": 40} | kw
    return nn.random_model(nn.LlamaConfig(**CFG), dtype="float32", device="cpu", seed=4, **args)


def _tokens(m: Any, view: Any) -> list[int]:
    return [int(x) for x in np.asarray(m.read(view).sync_on(m.device_stream))]


def test_tokens_none_continues_as_the_tokens_do() -> None:
    prompts = [[5, 6, 7], [9] * 20]
    outs = []
    for use_none in (False, True):
        m = _model()
        for i, p in enumerate(prompts):
            m.prefill(i, p, sample=True)
        last = _tokens(m, m.runner.rows.tokens[:2])
        seq = [last]
        for k in range(6):
            pos = [len(p) + k for p in prompts]
            if use_none and k > 0:
                view = m.runner.decoder.step([0, 1], None, pos, False)
            else:
                view = m.decode_step([0, 1], last, pos, graph=False)
            last = _tokens(m, view)[:2]
            seq.append(last)
        outs.append(seq)
    assert outs[0] == outs[1]


def test_tokens_none_feeds_the_prefill_token_as_the_host_token_does() -> None:
    """A row primed by its prefill's sampled token (never read) decodes, through the public
    ``decode_step(tokens=None)``, exactly what feeding the read token gives; one row fed
    from its prefill beside one continuing from a decode step too."""
    prompts = [[5, 6, 7], [9] * 20]
    outs = []
    for use_none in (False, True):
        m = _model()
        m.prefill(0, prompts[0], sample=True)
        first0 = _tokens(m, m.runner.rows.tokens[:1])[0]
        view = m.decode_step([0], None if use_none else [first0], [3], graph=False)
        a = _tokens(m, view)[0]
        m.prefill(1, prompts[1], sample=True)  # row 1 primed while row 0 continues
        first1 = _tokens(m, m.runner.rows.tokens[:2])[1]
        view = m.decode_step([0, 1], None if use_none else [a, first1], [4, 20], graph=False)
        b = _tokens(m, view)[:2]
        view = m.decode_step([0, 1], None if use_none else b, [5, 21], graph=False)
        outs.append([first0, a, first1, b, _tokens(m, view)[:2]])
    assert outs[0] == outs[1]


def test_tokens_none_refused_for_a_row_whose_token_is_not_on_the_device() -> None:
    m = _model()
    m.prefill(0, [1, 2, 3], sample=True)
    with pytest.raises(ValueError, match=r"rows \[0\] do neither"):
        m.decode_step([0], None, [4])  # primed for position 3, not 4
    m.prefill(1, [1, 2, 3], sample=False)  # nothing sampled: nothing to feed
    with pytest.raises(ValueError, match=r"rows \[1\] do neither"):
        m.decode_step([0, 1], None, [3, 3])
    t = _tokens(m, m.runner.rows.tokens[:1])
    m.decode_step([0], t, [3], graph=False)
    with pytest.raises(ValueError, match="tokens=None needs every row to continue"):
        m.decode_step([0], None, [7], graph=False)  # not its next position
    m.decode_step([0], None, [4], graph=False)  # its next position: fed from the device
    with pytest.raises(ValueError, match="tokens=None needs every row"):
        m.decode_step([0], None, [4], graph=False)  # the same position twice
    m.release(0)
    with pytest.raises(ValueError, match="tokens=None needs every row"):
        m.decode_step([0], None, [5], graph=False)  # released: nothing continues
    with pytest.raises(ValueError, match=r"tokens \(None\)"):
        m.decode_step([], None, [])


def test_batch_rows_stopping_at_different_steps_match_each_alone() -> None:
    m = _model(max_seq=40)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 96, n).tolist() for n in (4, 9, 33, 17)]  # 33: max_seq at 7 new
    for stop in (None, [11, 40, 57]):
        for t, seed in ((0.0, None), (1.0, 123)):
            kw = {"temperature": t, "seed": seed, "stop": stop}
            batch = m.generate(prompts, 12, **kw)
            alone = [m.generate(p, 12, **kw) for p in prompts]
            assert batch == alone, (stop, t)
            assert len(batch[2]) <= 40 - 33 + 1  # no position fed at or past max_seq
            assert all(len(r) <= 12 for r in batch)
    assert all(m.blocks_held(i) == 0 for i in range(4))


def test_stream_gives_what_generate_gives() -> None:
    m = _model()
    want = m.generate([3, 4, 5, 6], 20, temperature=1.0, seed=7)

    async def run() -> list[int]:
        return [t async for t in m.stream([3, 4, 5, 6], 20, temperature=1.0, seed=7)]

    assert anyio.run(run) == want
    assert m.blocks_held(0) == 0


def test_stream_closed_early_gives_its_blocks_back() -> None:
    m = _model()

    async def run() -> list[int]:
        got = []
        agen = m.stream([3, 4, 5, 6], 30)
        async for t in agen:
            got.append(t)
            if len(got) == 3:
                break
        await agen.aclose()
        return got

    assert len(anyio.run(run)) == 3
    assert m.blocks_held(0) == 0
    assert m.generate([3, 4, 5, 6], 5) == m.generate([3, 4, 5, 6], 5)  # the model still works
    assert np.asarray(api.to_host(m.runner.rows.tokens).sync_on(m.device_stream)).dtype == np.int32


def test_both_loops_give_the_same_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    # (each loop is its own code: positions or stops wrong in one of them show here)
    m = _model(max_seq=40)
    rng = np.random.default_rng(8)
    prompts = [rng.integers(3, 96, n).tolist() for n in (4, 9, 33, 17)]
    got = {}
    for ahead in (False, True):
        monkeypatch.setattr(static_batch, "AHEAD_ON_CPU", ahead)
        got[ahead] = [m.generate(prompts, 12, stop=[11, 40], temperature=t, seed=5)
                      for t in (0.0, 1.0)]
    assert got[True] == got[False]


def test_the_ahead_loop_runs_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[bool] = []
    real = static_batch._Rows.step

    def spy(self: Any, rows: list[int], *, known: bool) -> Any:
        calls.append(known)
        return real(self, rows, known=known)

    monkeypatch.setattr(static_batch._Rows, "step", spy)
    m = _model()
    for ahead in (False, True):
        monkeypatch.setattr(static_batch, "AHEAD_ON_CPU", ahead)
        calls.clear()
        m.generate([3, 4, 5], 6)

        async def run() -> list[int]:
            return [t async for t in m.stream([3, 4, 5], 6)]

        assert len(anyio.run(run)) == 6
        assert (calls.count(False) > 0) == ahead, (ahead, calls)


def test_stream_of_one_token() -> None:
    m = _model()

    async def run() -> list[int]:
        return [t async for t in m.stream([3, 4, 5], 1)]

    got = anyio.run(run)
    assert got == m.generate([3, 4, 5], 1) and len(got) == 1


def test_a_continuing_step_uploads_no_row_state(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows continuing from the previous decode step at their next positions upload nothing
    (the device state is advanced by the step itself); a row joining uploads once."""
    m = _model()
    rows = m.runner.rows
    uploads: list[bool] = []
    real = rows.upload_state

    def counting(state: Any, *, tokens: bool = True) -> None:
        uploads.append(tokens)
        real(state, tokens=tokens)

    monkeypatch.setattr(rows, "upload_state", counting)
    m.prefill(0, [5, 6, 7], sample=True)
    m.prefill(1, [9] * 20, sample=True)
    m.decode_step([0, 1], None, [3, 20], graph=False)  # joining: one upload, tokens kept
    assert uploads == [False]
    for k in range(1, 4):
        m.decode_step([0, 1], None, [3 + k, 20 + k], graph=False)
    assert uploads == [False]  # continuing: nothing uploaded
    m.decode_step([1], None, [24], graph=False)  # row 0 left (idle in the bucket): once
    assert uploads == [False, False]
    m.decode_step([1], None, [25], graph=False)
    assert uploads == [False, False]
