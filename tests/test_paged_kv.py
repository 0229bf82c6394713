"""Paged KV cache: every decode step's logits against a dense float64 reference.

A tiny random Llama (cpu backend, float32) with blocks of 4 positions decodes several rows
in one batch (greedy), and after *every* step each active row's
logits (``CausalLM``'s logits buffer, what ``sample`` reads) are compared with the float64
NumPy forward of the row's whole sequence (``nn_tiny.reference_logits``, no cache at all).
The positions written cover every slot of a block in several blocks of every row; rows get
scattered block ids (other blocks held in between), and a row that finishes frees its blocks,
which a new row then reuses (stale keys and values in them must not leak). The same on the
graph (record and replay) path and for a prompt prefilled in several chunks, on each of the
cpu backend's kernel paths (its float32 paths and the float64 references).

Mutants these tests were written to kill (tests/MUTATION.md): decode K/V written one slot
early at a block's last slot; V (or K) dropped at block ends; a block-table entry off by one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from deviceops import api

from . import nn_tiny

pytestmark = [pytest.mark.timeout(60)]

BS = 4  # positions per block
TOL = 2e-5  # float32 forward vs the float64 reference, relative to the row's largest logit


def _modes() -> dict[str, Callable[[], Any]]:
    """The cpu backend's kernel paths: the float32 paths and the float64 references (where
    the backend has both, ``kernels/*/_cpu.py``), each compared with the dense reference."""
    try:
        from deviceops.kernels.runtime._cpu import use_reference
    except ImportError:
        return {"default": contextlib.nullcontext}
    return {"fast": lambda: use_reference(False), "reference": lambda: use_reference(True)}


MODES = _modes()


@pytest.fixture(params=sorted(MODES))
def mode(request: pytest.FixtureRequest) -> Iterator[str]:
    with MODES[request.param]():
        yield str(request.param)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, dict[str, np.ndarray]]:
    from deviceops import nn

    path = Path(tmp_path_factory.mktemp("paged_kv")) / "tiny.gguf"
    held = nn_tiny.write_gguf(path, nn_tiny.hf_weights(5, tied=False), "F32")
    m = nn.load_gguf(path, device="cpu", dtype="float32", max_batch=4, max_seq=32,
                     prefill_chunk=8, kv_block_size=BS, kv_blocks=40)
    return m, held


def _tokens(n: int, seed: int, vocab: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, vocab, n).tolist()


def _logits(m: Any, b: int) -> np.ndarray:
    s = m.device_stream
    return np.asarray(api.to_host(m.runner.logits[:b]).sync_on(s), np.float64)


def _check(held: dict[str, np.ndarray], seq: list[int], got: np.ndarray, what: str) -> None:
    ref = nn_tiny.reference_logits(held, seq)[-1]
    err = float(np.abs(got - ref).max() / np.abs(ref).max())
    assert err < TOL, f"{what}: logits after {len(seq)} positions off by {err:.2e} (relative)"


class Rows:
    """Host bookkeeping of the rows a test decodes: the sequence each row's cache holds and
    the token it sampled last (greedy), which the next decode step feeds (``decode_step``'s
    contract: a continuing row feeds the token it sampled)."""

    def __init__(self, m: Any, held: dict[str, np.ndarray], graph: bool) -> None:
        self.m, self.held, self.graph = m, held, graph
        self.seqs: dict[int, list[int]] = {}
        self.last: dict[int, int] = {}

    def start(self, slot: int, prompt: list[int]) -> None:
        m = self.m
        m.set_sampling(slot)
        view = m.prefill(slot, prompt, graph=self.graph)
        self.last[slot] = int(m.read(view).sync_on(m.device_stream)[0])
        self.seqs[slot] = list(prompt)
        # the prefill's last-position logits sit in row 0 of the buffer
        got = _logits(m, 1)[0]
        _check(self.held, self.seqs[slot], got, f"prefill of row {slot}")
        assert self.last[slot] == int(np.argmax(got))

    def step(self, slots: list[int]) -> None:
        m = self.m
        pos = [len(self.seqs[x]) for x in slots]
        view = m.decode_step(slots, [self.last[x] for x in slots], pos, graph=self.graph)
        toks = m.read(view).sync_on(m.device_stream)
        got = _logits(m, len(toks))
        for x in slots:
            self.seqs[x].append(self.last[x])
            p = len(self.seqs[x]) - 1
            _check(self.held, self.seqs[x], got[x],
                   f"row {x} decode at position {p} (slot {p % BS} of block {p // BS})")
            self.last[x] = int(toks[x])
            assert self.last[x] == int(np.argmax(got[x]))

    def release(self, slot: int) -> None:
        self.m.release(slot)
        del self.seqs[slot], self.last[slot]


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_decode_logits_match_dense_reference_across_blocks(model: Any, graph: bool,
                                                           mode: str) -> None:
    m, held = model
    v = m.config.vocab_size
    hold = m.blocks.acquire(9)  # scattered ids: every other block held by nobody in use
    assert hold is not None
    m.blocks.release(hold[::2])
    rows = Rows(m, held, graph)
    try:
        # prompts ending at every slot offset of a block; rows 0..2 decode together
        for slot, n in ((0, 1), (1, 6), (2, 3)):
            rows.start(slot, _tokens(n, 10 + slot, v))
        for _ in range(9):  # row 1: positions 6..14, rows 0/2 every slot of blocks 0..2
            rows.step([0, 1, 2])
        assert m.blocks_held(1) == 4
        # row 1 finishes; its blocks go back and row 3 takes them (stale K/V inside)
        filler = m.blocks.acquire(m.blocks.free)  # the pool is full ...
        assert filler is not None
        freed = list(m.runner.kv.row_blocks[1])
        rows.release(1)  # ... but for row 1's blocks
        rows.start(3, _tokens(2, 13, v))
        assert m.runner.kv.row_blocks[3] and set(m.runner.kv.row_blocks[3]) <= set(freed)
        m.blocks.release(filler)
        for _ in range(8):  # rows 0, 2, 3 (a gap at row 1 in the bucket)
            rows.step([0, 2, 3])
        assert len(rows.seqs[0]) == 18 and m.blocks_held(0) == 5
    finally:
        for slot in list(rows.seqs):
            rows.release(slot)
        m.blocks.release(hold[1::2])
    assert m.blocks.in_use == 0


def test_chunked_prefill_then_decode_match_dense_reference(model: Any, mode: str) -> None:
    """A prompt of 19 tokens in chunks of 8 (boundaries inside blocks), then decode."""
    m, held = model
    v = m.config.vocab_size
    rows = Rows(m, held, graph=False)
    try:
        rows.start(2, _tokens(19, 31, v))
        for _ in range(6):
            rows.step([2])
    finally:
        for slot in list(rows.seqs):
            rows.release(slot)
    assert m.blocks.in_use == 0
