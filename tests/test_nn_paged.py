"""The paged KV cache of ``CausalLM`` (block pool + block table in device memory) and the
engine's block allocation, on a tiny random Llama (cpu backend, float32).

Rows are given scattered, non-contiguous blocks (other blocks held in between), tokens are
checked against the float64 NumPy Llama, graph prefill/decode against eager, and the block
accounting (reserve, release, pool exhausted, engine admission waiting for blocks) exactly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

from deviceops import api

from . import nn_tiny

pytestmark = [pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def paged(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, dict[str, np.ndarray]]:
    from deviceops import nn

    path = Path(tmp_path_factory.mktemp("paged")) / "tiny.gguf"
    held = nn_tiny.write_gguf(path, nn_tiny.hf_weights(3, tied=True), "F32")
    # 4 rows of 40 positions in blocks of 3: 14 blocks a full row; a pool of 30 (29 usable)
    m = nn.load_gguf(path, device="cpu", dtype="float32", max_batch=4, max_seq=40,
                     prefill_chunk=16, kv_block_size=3, kv_blocks=30)
    return m, held


ref_greedy = nn_tiny.reference_greedy


def prompts(m: Any, lengths: tuple[int, ...], seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, m.config.vocab_size, n).tolist() for n in lengths]


def test_scattered_blocks_match_reference_graph_and_eager(paged: Any) -> None:
    m, held = paged
    assert (m.block_size, m.max_blocks, m.cache.num_blocks, m.blocks.capacity) == (3, 14, 30, 29)
    assert m.cache.k[0].shape == (30, m.config.num_kv_heads, 3, m.config.head_dim)
    # hold every other block so the rows get scattered ids
    hold = m.blocks.acquire(12)
    assert hold is not None
    m.blocks.release(hold[::2])
    try:
        ps = prompts(m, (7, 11, 2), 1)
        want = [ref_greedy(held, p, 6) for p in ps]
        assert m.generate(ps, 6, graph=False) == want
        assert m.blocks.in_use == 6  # rows released their blocks when done
        assert m.generate(ps, 6, graph=True) == want
        g16 = set(m.runner.prefiller.graphs)
        assert g16 == {(16, True)}  # one prefill graph, all three rows
        assert m.blocks.in_use == 6
    finally:
        m.blocks.release(hold[1::2])
    assert m.blocks.in_use == 0


def test_reserve_table_release_and_full_pool(paged: Any) -> None:
    m, held = paged
    s = m.device_stream
    assert m.reserve(1, 7)  # 3 blocks
    assert m.blocks_held(1) == 3 and m.reserve(1, 5) and m.blocks_held(1) == 3
    assert m.reserve(2, 40) and m.blocks_held(2) == 14
    table = np.asarray(api.to_host(m.runner.kv.table).sync_on(s))
    ids1, ids2 = m.runner.kv.row_blocks[1], m.runner.kv.row_blocks[2]
    assert table[1, :3].tolist() == ids1 and (table[1, 3:] == 0).all()
    assert table[2].tolist() == ids2 and not set(ids1) & set(ids2) and 0 not in ids1 + ids2
    free = m.blocks.free
    assert free == 29 - 17
    assert not m.reserve(3, 40)  # 14 > 12 free: nothing taken
    assert m.blocks.free == free and m.blocks_held(3) == 0
    seq = s.seq
    from deviceops.nn import KVCacheFull

    with pytest.raises(KVCacheFull, match=r"prefill: row 3 needs 14 more KV blocks.*12 free of 29"):
        m.prefill(3, list(range(3, 43)))
    assert s.seq == seq and m.blocks.free == free  # nothing enqueued, nothing taken
    with pytest.raises(ValueError, match=r"reserve: n_tokens=41"):
        m.reserve(0, 41)
    m.release(2)
    m.release(1)
    assert m.blocks.in_use == 0 and m.blocks_held(1) == 0
    # decode grows a row block by block (a row prefilled to 6 positions holds 2 blocks)
    p = prompts(m, (6,), 5)[0]
    m.set_sampling(0)
    tok = int(m.read(m.prefill(0, p)).sync_on(s)[0])
    assert m.blocks_held(0) == 2
    out = [tok]
    for i in range(4):
        out.append(int(m.read(m.decode_step([0], [out[-1]], [6 + i])).sync_on(s)[0]))
        assert m.blocks_held(0) == -(-(7 + i) // 3)
    m.release(0)
    assert out == ref_greedy(held, p, 5) and m.blocks.in_use == 0


def test_bad_paged_arguments(tmp_path: Path) -> None:
    from deviceops import nn

    path = tmp_path / "t.gguf"
    nn_tiny.write_gguf(path, nn_tiny.hf_weights(1, tied=True), "F32")
    with pytest.raises(ValueError, match="kv_blocks=1 must be an int >= 2"):
        nn.load_gguf(path, device="cpu", max_batch=2, max_seq=8, kv_blocks=1)
    with pytest.raises(ValueError, match="kv_block_size=0"):
        nn.load_gguf(path, device="cpu", max_batch=2, max_seq=8, kv_block_size=0)
    m = nn.load_gguf(path, device="cpu", max_batch=2, max_seq=10, kv_block_size=4)
    assert m.cache.num_blocks == 2 * 3 + 1 and m.max_blocks == 3
    # a request whose budget exceeds the whole pool is refused before queueing
    small = nn.load_gguf(path, device="cpu", max_batch=2, max_seq=40, kv_block_size=4, kv_blocks=6)
    eng = nn.Engine(small, max_batch=2, max_seq=40)
    with pytest.raises(ValueError, match=r"needs more KV blocks than the pool's 5 of 4 positions"):
        eng.stream([5, 6, 7], 30)
    eng.stream([5, 6, 7], 10).cancel()
    assert eng.stats().queued == 0


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_engine_admission_waits_for_blocks(paged: Any, backend: str) -> None:
    """8 requests on 4 rows whose budgets need 9 to 12 blocks each: at most 3 hold blocks at
    once (29 usable), every result equals the reference, and all blocks come back."""
    from deviceops.nn import Engine

    m, held = paged
    ps = prompts(m, (9, 4, 13, 6, 10, 5, 8, 12), 9)
    want = {i: ref_greedy(held, p, 22 - len(p) % 3) for i, p in enumerate(ps)}
    peak = {"blocks": 0, "running": 0}

    async def main() -> dict[int, list[int]]:
        eng = Engine(m, max_batch=4, max_seq=40)
        got: dict[int, list[int]] = {}

        async def one(i: int) -> None:
            toks = []
            async for t in eng.stream(ps[i], 22 - len(ps[i]) % 3, ignore_eos=True):
                toks.append(t)
                st = eng.stats()
                peak["blocks"] = max(peak["blocks"], st.kv_blocks_in_use)
                peak["running"] = max(peak["running"], st.running)
                assert st.kv_blocks_in_use <= st.kv_blocks_total == 29
            got[i] = toks

        async with anyio.create_task_group() as tg:
            for i in range(len(ps)):
                tg.start_soon(one, i)
        st = eng.stats()
        assert (st.kv_blocks_in_use, st.slots_in_use, st.running, st.queued) == (0, 0, 0, 0)
        return got

    got = anyio.run(main, backend=backend)
    assert got == want
    assert 2 <= peak["running"] <= 3 and peak["blocks"] <= 29  # blocks, not rows, bound it
    assert m.blocks.in_use == 0


def test_stream_stopped_early_and_failed_generate_give_blocks_back(paged: Any) -> None:
    m, held = paged
    p = prompts(m, (8,), 11)[0]

    async def main() -> list[int]:
        it = m.stream(p, 10)
        got = []
        async for t in it:
            got.append(t)
            if len(got) == 3:
                break
        assert m.blocks.in_use == 4  # positions 0..9 written: 4 blocks of 3
        await it.aclose()
        return got

    assert anyio.run(main) == ref_greedy(held, p, 3)
    assert m.blocks.in_use == 0
    hog = m.blocks.acquire(m.blocks.free - 2)  # 2 blocks left: the second row cannot prefill
    assert hog is not None
    from deviceops.nn import KVCacheFull

    with pytest.raises(KVCacheFull):
        m.generate([p[:3], p], 2)
    m.blocks.release(hog)
    assert m.blocks.in_use == 0  # the first row's block came back too


def test_paged_prefill_switch_equals_contiguous_first_chunk(paged: Any) -> None:
    """DEVICEOPS_NN_PAGED_PREFILL's switch: every chunk through the paged cache gives the
    same tokens (graph and eager) as the contiguous first chunk."""
    m, held = paged
    ps = prompts(m, (7, 20, 2), 4)
    want = [ref_greedy(held, p, 5) for p in ps]
    assert m.contiguous_first_chunk
    try:
        m.contiguous_first_chunk = False
        assert m.generate(ps, 5, graph=False) == want
        assert m.generate(ps, 5, graph=True) == want
        assert (16, False) in m.runner.prefiller.graphs  # (chunks of 16)
    finally:
        m.contiguous_first_chunk = True
    assert m.generate(ps, 5, graph=True) == want and m.blocks.in_use == 0
