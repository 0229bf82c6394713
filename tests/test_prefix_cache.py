"""Prefix caching (issue 43, point 2): full KV blocks keyed by the hash of their token
prefix, reference-counted, shared read-only, evicted least recently used first.

The pieces on their own (hash chain, allocator counts and LRU, block table sharing and
caching, the runner's refusal to write into a cached block), then the engine on the tiny
random Llama (cpu backend, float32, blocks of 4 positions): greedy outputs equal the float64
NumPy reference with and without the cache for requests sharing a long system prefix
(prompts entirely cached, prompts diverging mid-block, one- and two-block prompts),
concurrent and one after another, under a pool small enough to evict; identical prompts
admitted together prefill the shared blocks once; the counters and the in-use / cached
block accounting.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

from deviceops.nn.runner import BlockAllocator, block_hashes

from . import nn_tiny
from .test_engine import Toy

pytestmark = [pytest.mark.timeout(180)]

BS = 4


# -- the pieces ---------------------------------------------------------------------------
def test_hash_chain_names_the_whole_prefix() -> None:
    a = block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], BS)
    assert len(a) == 2 and all(len(h) == 16 for h in a)  # the partial third block: none
    assert block_hashes([1, 2, 3, 4, 5, 6, 7, 8], BS) == a
    b = block_hashes([0, 2, 3, 4, 5, 6, 7, 8], BS)
    assert b[0] != a[0] and b[1] != a[1]  # same tokens in block 1, another prefix
    c = block_hashes([1, 2, 3, 4, 5, 6, 7, 0], BS)
    assert c[0] == a[0] and c[1] != a[1]
    assert block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], BS, known=a) == \
        block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], BS)
    with pytest.raises(ValueError, match="block_size=0"):
        block_hashes([1], 0)
    assert len(block_hashes([1, 2, 3], 1)) == 3  # blocks of one position are blocks too


def test_allocator_counts_references_parks_cached_blocks_and_evicts_lru() -> None:
    a = BlockAllocator(7, BS)  # 6 usable
    h = block_hashes(list(range(12)), BS)
    ids = a.acquire(3)
    assert ids == [1, 2, 3] and a.in_use == 3 and a.free == 3
    assert a.cache(h[0], 1) and a.cache(h[1], 2)
    assert not a.cache(h[0], 3)  # that prefix is cached already: block 3 stays private
    assert not a.cache(h[2], 1)  # block 1 has its hash
    a.share([1])  # a second row reads block 1
    assert a.refs(1) == 2 and a.in_use == 3
    a.release(ids)
    assert (a.in_use, a.cached, a.idle, a.free) == (1, 2, 1, 5)  # 1 still read; 2 idle; 3 free
    a.release([1])
    assert (a.in_use, a.cached, a.idle, a.free) == (0, 2, 2, 6)
    # block 2 went idle before block 1: it is the least recently used
    got = a.acquire(5)  # the 4 free blocks, then one eviction
    assert got == [3, 4, 5, 6, 2] and a.cached == 1 and a.prefix.lookup(h[1]) is None
    assert a.prefix.lookup(h[0]) == 1 and a.acquire(2) is None and a.free == 1
    a.share([1])  # an idle block is taken back by a row: no longer reclaimable
    assert a.free == 0 and a.acquire(1) is None
    with pytest.raises(ValueError, match="neither held nor cached"):
        a.share([0])
    with pytest.raises(ValueError, match=r"blocks \[1, 1\] are not held"):
        a.release([1, 1])  # one reference, released twice
    a.release([1, *got])
    assert a.in_use == 0 and a.clear_cache() == 1 and (a.cached, a.free) == (0, 6)
    with pytest.raises(ValueError, match="not held"):
        a.cache(h[0], 4)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, np.ndarray]]:
    path = Path(tmp_path_factory.mktemp("prefix")) / "tiny.gguf"
    # an untied head: its tokens' probabilities are far from 1 and move with the context
    held = nn_tiny.write_gguf(path, nn_tiny.hf_weights(3, tied=False), "F32")
    return path, held


def _model(tiny: tuple[Path, Any], *, kv_blocks: int = 80, max_seq: int = 64) -> Any:
    from deviceops import nn

    return nn.load_gguf(tiny[0], device="cpu", dtype="float32", max_batch=4, max_seq=max_seq,
                        prefill_chunk=16, kv_block_size=BS, kv_blocks=kv_blocks)


def test_rows_share_cached_blocks_and_never_write_into_them(tiny: Any) -> None:
    m = _model(tiny)
    _, held = tiny
    s = m.device_stream
    p = list(range(5, 19))  # 14 tokens: 3 full blocks
    h = block_hashes(p, BS)
    m.set_sampling(0)
    first = int(m.read(m.prefill(0, p)).sync_on(s)[0])
    assert m.cache_prefix(0, h) == 3 and m.cache_prefix(0, h) == 0  # once
    rows0 = list(m.runner.kv.row_blocks[0])
    assert m.share_prefix(1, h[:2], 0) == 8  # row 1 reads row 0's first two blocks
    assert m.runner.kv.row_blocks[1] == rows0[:2] and m.blocks.refs(rows0[0]) == 2
    with pytest.raises(ValueError, match=r"positions 0\.\.7 are cached blocks"):
        m.prefill(1, p[4:], 4)
    m.set_sampling(1)
    tok = int(m.read(m.prefill(1, p[8:], 8)).sync_on(s)[0])  # the rest, from position 8
    assert tok == first == nn_tiny.reference_greedy(held, p, 1)[0]
    # a row that reserved blocks first gives back the unwritten ones cached blocks replace
    assert m.reserve(2, 12) and m.blocks_held(2) == 3
    mine = list(m.runner.kv.row_blocks[2])
    assert m.share_prefix(2, h, 0) == 12 and m.runner.kv.row_blocks[2] == rows0[:3]
    assert all(m.blocks.refs(b) == 0 for b in mine)
    import deviceops.api as api

    table = np.asarray(api.to_host(m.runner.kv.table).sync_on(s))
    assert table[2, :3].tolist() == rows0[:3] and table[1, :2].tolist() == rows0[:2]
    with pytest.raises(ValueError, match="not a multiple of the block size"):
        m.share_prefix(3, h, 2)
    # a row whose blocks are all full: its hashes may name every one of them
    m.set_sampling(3)
    m.prefill(3, p[:12])
    assert m.blocks_held(3) == 3 and m.cache_prefix(3, h) == 0  # row 0's blocks hold them
    with pytest.raises(ValueError, match="4 block hashes for row 3, which holds 3 blocks"):
        m.cache_prefix(3, block_hashes(p[:12] + p[:4], BS))
    for r in (0, 1, 2, 3):
        m.release(r)
    assert m.blocks.in_use == 0 and m.blocks.cached == 3 and m.blocks.idle == 3


# -- the engine ---------------------------------------------------------------------------
SYSTEM = [int(t) for t in np.random.default_rng(7).integers(3, 200, 22)]


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(8)
    tail = [rng.integers(3, 200, k).tolist() for k in (1, 3, 6, 11)]
    return [
        SYSTEM + tail[0],
        SYSTEM + tail[1],
        SYSTEM[:10] + tail[2],  # diverges mid-block (block 2 holds 2 system tokens)
        SYSTEM[:8],  # two full blocks only: the second is recomputed, never shared
        SYSTEM,  # entirely cached after the first request: its last block is recomputed
        SYSTEM[:4],  # one block
        SYSTEM[:3] + tail[3],  # diverges inside the first block: nothing to share
        SYSTEM + tail[0],  # the first prompt again: everything but its last block cached
    ]


def check_logprobs(held: dict[str, np.ndarray], prompt: list[int], toks: list[int],
                   lps: list[Any]) -> None:
    """Each token's log-probability and its top alternatives' equal the float64 reference's
    over the whole sequence: a row that read wrong keys and values fails here even where its
    greedy token happens to be right."""
    seq = prompt + toks
    logits = nn_tiny.reference_logits(held, seq[:-1])[len(prompt) - 1:]
    ref = logits - logits.max(-1, keepdims=True)
    ref = ref - np.log(np.exp(ref).sum(-1, keepdims=True))
    assert len(lps) == len(toks)
    for i, (t, lp) in enumerate(zip(toks, lps, strict=True)):
        got = [lp.logprob, *(v for _, v in lp.top)]
        want = [ref[i, t], *(ref[i, j] for j, _ in lp.top)]
        np.testing.assert_allclose(got, want, atol=2e-3, err_msg=f"prompt {prompt}, token {i}")
        assert [j for j, _ in lp.top] == np.argsort(-ref[i])[:len(lp.top)].tolist()


async def _run(m: Any, prompts: list[list[int]], *, concurrent: bool,
               held: dict[str, np.ndarray] | None = None, **kw: Any
               ) -> tuple[list[list[int]], Any]:
    """Each prompt's 7 greedy tokens (their log-probabilities checked against the reference
    when ``held`` is given) and the engine."""
    from deviceops.nn import Engine

    eng = Engine(m, max_batch=4, max_seq=m.max_seq, prefill_chunk=16, **kw)
    out: dict[int, list[int]] = {}

    async def one(i: int, s: Any) -> None:
        out[i] = [t async for t in s]
        if held is not None:
            check_logprobs(held, prompts[i], out[i], s.logprobs)

    def start(i: int) -> Any:
        return eng.stream(prompts[i], 7, ignore_eos=True, logprobs=3)

    if concurrent:  # all queued before the first step: admitted together
        streams = [start(i) for i in range(len(prompts))]
        async with anyio.create_task_group() as tg:
            for i, s in enumerate(streams):
                tg.start_soon(one, i, s)
    else:
        for i in range(len(prompts)):
            await one(i, start(i))
    return [out[i] for i in range(len(prompts))], eng


@pytest.mark.parametrize("concurrent", [False, True], ids=["sequential", "concurrent"])
@pytest.mark.parametrize("kv_blocks", [80, 20], ids=["roomy", "evicting"])
def test_greedy_outputs_equal_with_and_without_the_cache(tiny: Any, concurrent: bool,
                                                         kv_blocks: int) -> None:
    _, held = tiny
    ps = _prompts()
    want = [nn_tiny.reference_greedy(held, p, 7) for p in ps]
    off_m, on_m = _model(tiny, kv_blocks=kv_blocks), _model(tiny, kv_blocks=kv_blocks)
    evicted: list[int] = []
    evict = on_m.blocks.prefix.evict

    def counted() -> int:
        evicted.append(evict())
        return evicted[-1]

    on_m.blocks.prefix.evict = counted
    off, off_eng = anyio.run(lambda: _run(off_m, ps, concurrent=concurrent, held=held,
                                          prefix_cache=False))
    on, on_eng = anyio.run(lambda: _run(on_m, ps, concurrent=concurrent, held=held))
    assert off == want and on == want
    assert bool(evicted) == (kv_blocks == 20)  # the small pool evicted cached blocks
    st0, st1 = off_eng.stats(), on_eng.stats()
    assert not off_eng.prefix_cache and on_eng.prefix_cache
    assert (st0.prefix_cache_hit_tokens, st0.prefix_cache_miss_tokens, st0.kv_blocks_cached) \
        == (0, 0, 0) and off_m.blocks.cached == 0
    total = sum(map(len, ps))
    assert st0.prefill_tokens == total
    assert st1.prefix_cache_hit_tokens > 0
    assert st1.prefix_cache_hit_tokens + st1.prefix_cache_miss_tokens == total
    assert st1.prefill_tokens == st1.prefix_cache_miss_tokens < total
    # nothing is in use once every request finished; what stays cached is reclaimable
    assert st1.kv_blocks_in_use == 0 == on_m.blocks.in_use
    assert st1.kv_blocks_cached == on_m.blocks.cached == on_m.blocks.idle > 0
    assert on_m.blocks.free == on_m.blocks.capacity
    assert on_eng.clear_prefix_cache() == st1.kv_blocks_cached
    assert on_m.blocks.cached == 0 and on_m.blocks.free == on_m.blocks.capacity
    assert off_eng.clear_prefix_cache() == 0


def test_sequential_hits_are_exactly_the_cached_full_blocks(tiny: Any) -> None:
    """One after another, each request shares every cached full block of its prompt but the
    one holding its last token; the counters say so token for token."""
    m = _model(tiny)
    ps = _prompts()
    _, eng = anyio.run(lambda: _run(m, ps, concurrent=False))
    # hits per request: 0 (first), 20 (5 system blocks), 8 (SYSTEM[:10]: 2 full blocks),
    # 4 (SYSTEM[:8]: its second block holds its last token), 20 (SYSTEM: 22 tokens),
    # 0 (one block: it holds the last token), 0 (diverges in block 0), 20 (again)
    hits = [0, 20, 8, 4, 20, 0, 0, 20]
    st = eng.stats()
    assert st.prefix_cache_hit_tokens == sum(hits)
    assert st.prefix_cache_miss_tokens == sum(map(len, ps)) - sum(hits)


def test_generated_blocks_are_cached_when_a_request_finishes(tiny: Any) -> None:
    """A follow-up prompt made of the earlier prompt and its reply (a chat's next turn)
    shares the blocks of both."""
    _, held = tiny
    m = _model(tiny)
    p = SYSTEM[:6]

    async def main() -> tuple[list[int], list[int], Any]:
        from deviceops.nn import Engine

        eng = Engine(m, max_batch=4, max_seq=64, prefill_chunk=16)
        first = await eng.generate(p, 11, ignore_eos=True)
        # positions 0..15 written (6 prompt + 10 fed replies): 4 full blocks cached
        assert m.blocks.cached == 4
        follow = p + first + [5, 6, 7]
        s = eng.stream(follow, 4, ignore_eos=True, logprobs=3)
        second = [t async for t in s]
        check_logprobs(held, follow, second, s.logprobs)
        return first, second, eng

    first, second, eng = anyio.run(main)
    assert first == nn_tiny.reference_greedy(held, p, 11)
    assert second == nn_tiny.reference_greedy(held, p + first + [5, 6, 7], 4)
    assert eng.stats().prefix_cache_hit_tokens == 16


def test_identical_prompts_admitted_together_prefill_the_shared_blocks_once(tiny: Any) -> None:
    """Four requests with one 30-token prompt, queued at once: the first prefills it (in
    two chunks of the 16-token budget); the others wait for its blocks, then share its 7 full
    blocks and prefill only their last 2 tokens each."""
    _, held = tiny
    m = _model(tiny)
    p = [int(t) for t in np.random.default_rng(3).integers(3, 200, 30)]
    out, eng = anyio.run(lambda: _run(m, [p] * 4, concurrent=True, held=held))
    assert out == [nn_tiny.reference_greedy(held, p, 7)] * 4
    st = eng.stats()
    assert st.prefill_tokens == 30 + 3 * 2 and st.prefix_cache_hit_tokens == 3 * 28
    assert m.blocks.in_use == 0
    off, off_eng = anyio.run(lambda: _run(_model(tiny), [p] * 4, concurrent=True,
                                          prefix_cache=False))
    assert off == out and off_eng.stats().prefill_tokens == 4 * 30


def test_admission_counts_shared_blocks_and_waits_for_the_rest(tiny: Any) -> None:
    """A pool of 15 usable blocks: a 40-position request holds 10; a second one with the
    same 24-token prompt start needs 10 blocks of which 6 are shared, so it fits (4 more);
    a third with another prompt needs 10 and waits until blocks come back."""
    _, held = tiny
    m = _model(tiny, kv_blocks=16, max_seq=40)
    rng = np.random.default_rng(11)
    a = [int(t) for t in rng.integers(3, 200, 25)]
    b = [*a[:24], 9]
    c = [int(t) for t in rng.integers(3, 200, 25)]
    seen: list[tuple[int, int]] = []

    async def main() -> list[list[int]]:
        from deviceops.nn import Engine

        eng = Engine(m, max_batch=4, max_seq=40, prefill_chunk=32)
        streams = [eng.stream(x, 15, ignore_eos=True, logprobs=3) for x in (a, b, c)]
        outs: list[list[int]] = [[], [], []]

        async def one(i: int) -> None:
            async for t in streams[i]:
                outs[i].append(t)
                st = eng.stats()
                seen.append((st.running, st.kv_blocks_in_use))
                assert st.kv_blocks_in_use <= 15
            check_logprobs(held, (a, b, c)[i], outs[i], streams[i].logprobs)

        async with anyio.create_task_group() as tg:
            for i in range(3):
                tg.start_soon(one, i)
        return outs

    outs = anyio.run(main)
    assert outs == [nn_tiny.reference_greedy(held, x, 15) for x in (a, b, c)]
    assert (2, 14) in seen  # a and b ran together on 10 + 4 blocks; c waited
    assert max(r for r, _ in seen) == 2 and m.blocks.in_use == 0


def test_prefix_cache_needs_a_step_model_that_has_it() -> None:
    from deviceops.nn import Engine

    assert not Engine(Toy()).prefix_cache
    assert not Engine(Toy(), prefix_cache=False).prefix_cache
    with pytest.raises(ValueError, match="prefix_cache=True, but Toy has no paged KV"):
        Engine(Toy(), prefix_cache=True)


def test_a_failed_prefill_empties_the_cache_and_the_engine_goes_on(tiny: Any) -> None:
    """A prompt chunk's blocks are cached when it is enqueued; when its result then fails,
    what they hold is unknown: the cache is emptied, the request ends with the error, and
    the next requests compute their blocks again (correctly)."""
    _, held = tiny
    m = _model(tiny)
    p = [*SYSTEM, 5, 6, 7]

    async def main() -> None:
        from deviceops.nn import Engine

        eng = Engine(m, max_batch=4, max_seq=64, prefill_chunk=16)
        await eng.generate(p, 3, ignore_eos=True)
        assert m.blocks.cached == 6  # 25 positions written: 6 full blocks
        real = eng.scheduler.submit_prefill

        def failing(*a: Any, **kw: Any) -> Any:
            real(*a, **kw)  # enqueued (and its blocks cached), then its result fails

            async def wait() -> None:
                raise RuntimeError("prefill result lost")

            return wait

        eng.scheduler.submit_prefill = failing
        s = eng.stream([*SYSTEM[:20], 9, 9, 9, 9, 9], 3, ignore_eos=True)
        with pytest.raises(RuntimeError, match="prefill result lost"):
            [t async for t in s]
        assert s.finish_reason == "error"
        assert m.blocks.cached == 0 and m.blocks.in_use == 0
        eng.scheduler.submit_prefill = real
        before = eng.stats()
        s = eng.stream(p, 5, ignore_eos=True, logprobs=3)
        toks = [t async for t in s]
        check_logprobs(held, p, toks, s.logprobs)
        st = eng.stats()
        assert st.prefill_tokens - before.prefill_tokens == len(p)  # nothing was reused

    anyio.run(main)


@pytest.mark.gpu
def test_prefix_cache_through_cuda_graphs_matches_the_cpu_backend() -> None:
    """On CUDA, prompt chunks after a cache hit replay the paged prefill graphs (the row's
    block table goes to the graph's input buffer): a SmolLM2-shaped random model (float32)
    with a 150-token shared prefix gives the cpu backend's greedy tokens, concurrent and one
    after another, and the same log-probabilities as with the cache off."""
    import deviceops

    from .test_nn_gpu_paged import random_model

    if not deviceops.cuda_available():
        pytest.skip("needs a CUDA GPU")
    kw = {"max_batch": 4, "max_seq": 320, "prefill_chunk": 128, "kv_block_size": 16,
          "kv_blocks": 90}
    rng = np.random.default_rng(5)
    system = rng.integers(1, 4096, 150).tolist()
    ps = [system + rng.integers(1, 4096, k).tolist() for k in (3, 20, 41)] + [system[:64]]
    want = random_model("cpu", "float32", **kw).generate(ps, 8)

    async def run(m: Any, cache: bool) -> tuple[list[list[int]], list[list[float]], Any]:
        from deviceops.nn import Engine

        eng = Engine(m, max_batch=4, max_seq=320, prefill_chunk=128, prefix_cache=cache)
        outs: list[list[int]] = []
        lps: list[list[float]] = []
        for together in (True, False):
            streams: list[Any] = []
            for p in ps:
                streams.append(eng.stream(p, 8, logprobs=2))
                if not together:
                    outs.append([t async for t in streams[-1]])
            if together:
                outs += [[t async for t in s] for s in streams]
            lps += [[lp.logprob for lp in s.logprobs] for s in streams]
        return outs, lps, eng.stats()

    gm = random_model(0, "float32", **kw)
    on, on_lp, st = anyio.run(run, gm, True)
    off, off_lp, st0 = anyio.run(run, random_model(0, "float32", **kw), False)
    assert on == off == want + want
    assert st.prefix_cache_hit_tokens > 0 and st0.prefix_cache_hit_tokens == 0
    assert st.prefill_tokens < st0.prefill_tokens
    np.testing.assert_allclose(np.concatenate(on_lp), np.concatenate(off_lp), atol=2e-3)
    assert gm.blocks.in_use == 0
