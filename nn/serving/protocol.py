"""The messages between a serving front and an engine core (:mod:`.core`, :mod:`.core_client`).

Transport and codec: **ZeroMQ** (pyzmq) sockets and **msgspec** MessagePack structs, the
pair vLLM V1 uses between its API server and ``EngineCore``: ZeroMQ gives message framing,
reconnection after a peer restarts and one socket that serves many peers (a ``ROUTER`` in
the core, a ``DEALER`` per front) on ``ipc://`` for a local core and ``tcp://`` for a
remote one; msgspec encodes a typed struct in about a microsecond and decodes it into the
same type, so a malformed message is refused at the boundary.

One core serves any number of fronts (``serve --api-servers N``). Each front opens a
``DEALER`` socket with its own identity, sends :class:`Hello`, and gets :class:`Ready`
(limits, features and, when asked, the tokenizer: the front tokenises and detokenises,
the core never does). Then:

| front -> core | core -> front |
|---|---|
| :class:`Submit` (token ids + sampling parameters, a grammar's text) | one :class:`Step` per engine step with news for that front: every request's new token ids as three arrays, the finished ones, log-probabilities when asked, the engine's stats and phase times |
| :class:`Cancel` (request ids) | :class:`Failed` once, when the engine failed (the core then exits and is restarted) |
| :class:`Bye` (cancel everything of this front) | |

Request ids are the front's own (unique per front). Token arrays are little-endian
``int64`` ids and ``int32`` counts and tokens (:func:`pack_i32` / :func:`unpack_i32`), so a
step of 64 rows is three byte strings, not 64 Python objects.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from typing import Any

import msgspec

__all__ = ["PHASE_NAMES", "Bye", "Cancel", "Failed", "Finish", "Hello", "Ready", "Step",
           "Submit", "decode_core", "decode_front", "encode", "pack_i32", "pack_i64",
           "unpack_i32", "unpack_i64"]

#: The host phases whose cumulative seconds every :class:`Step` carries, in order: the
#: scheduler's (admit, enqueue, wait, deliver), then the core's own ``recv`` (handling
#: front messages) and ``send`` (collecting, encoding and sending step messages).
PHASE_NAMES = ("admit", "enqueue", "wait", "deliver", "recv", "send")

_LITTLE = sys.byteorder == "little"


def _pack(code: str, xs: Sequence[int]) -> bytes:
    a = array(code, xs)
    if not _LITTLE:
        a.byteswap()
    return a.tobytes()


def _unpack(code: str, b: bytes) -> list[int]:
    a = array(code)
    a.frombytes(b)
    if not _LITTLE:
        a.byteswap()
    return a.tolist()


def pack_i32(xs: Sequence[int]) -> bytes:
    """``xs`` as little-endian int32 bytes."""
    return _pack("i", xs)


def unpack_i32(b: bytes) -> list[int]:
    """The ints :func:`pack_i32` packed."""
    return _unpack("i", b)


def pack_i64(xs: Sequence[int]) -> bytes:
    """``xs`` as little-endian int64 bytes."""
    return _pack("q", xs)


def unpack_i64(b: bytes) -> list[int]:
    """The ints :func:`pack_i64` packed."""
    return _unpack("q", b)


# -- front -> core --------------------------------------------------------------------------
class Hello(msgspec.Struct, tag="hello", array_like=True):
    """A front connects (or reconnects); the core answers :class:`Ready`.

    ``info``: include the tokenizer, config and chat template (a front's first hello)."""

    info: bool = True


class Submit(msgspec.Struct, tag="submit", array_like=True):
    """One request: the prompt's token ids (:func:`pack_i32`) and the sampling parameters,
    already checked by the front (the core checks them again)."""

    rid: int
    prompt: bytes
    max_new: int
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: list[int] = []
    ignore_eos: bool = False
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[int, float] | None = None
    logprobs: int | None = None
    #: the grammar the reply follows (llguidance's formats, :mod:`.grammar`): the core
    #: compiles it against the model's tokenizer
    grammar: str | None = None


class Cancel(msgspec.Struct, tag="cancel", array_like=True):
    """Cancel these requests of this front (their KV slots are freed)."""

    rids: list[int]


class Bye(msgspec.Struct, tag="bye", array_like=True):
    """This front is going away: cancel every request it has in this core."""


# -- core -> front --------------------------------------------------------------------------
class Ready(msgspec.Struct, tag="ready", array_like=True):
    """The core serves. ``info``: ``vocab_size``, ``eos_ids``, ``max_seq``, ``max_batch``,
    ``max_queue``, ``features`` (sampling features), ``device``, ``pid``, ``kv_block_size``;
    with :attr:`Hello.info` also ``tokenizer`` (its JSON), ``config`` and ``chat_template``."""

    info: dict[str, Any]


class Finish(msgspec.Struct, array_like=True):
    """A finished request: ``reason`` ``"stop"``, ``"length"``, ``"cancelled"`` or
    ``"error"``; with an error, its ``kind`` (``"invalid"``, ``"overloaded"``,
    ``"closed"``, ``"failed"``, ``"error"``) and message."""

    rid: int
    reason: str
    kind: str | None = None
    message: str | None = None


class Step(msgspec.Struct, tag="step", array_like=True):
    """One engine step's news for one front.

    ``rids`` (int64), ``counts`` and ``tokens`` (int32): request ``rids[i]`` got
    ``counts[i]`` new tokens, the next ``counts[i]`` of ``tokens``. ``done``: requests that
    finished (after their last tokens above). ``logprobs``: ``(rid, token, logprob,
    top)`` for each token of a request that asked for them. ``stats``: the engine's
    :class:`~.requests.EngineStats` fields in order. ``phases``: cumulative host seconds
    per :data:`PHASE_NAMES`.
    """

    rids: bytes
    counts: bytes
    tokens: bytes
    done: list[Finish]
    logprobs: list[tuple[int, int, float, list[tuple[int, float]]]] | None
    stats: list[int]
    phases: list[float]


class Failed(msgspec.Struct, tag="failed", array_like=True):
    """The core's engine failed (fail-stop): it ends every request and exits."""

    message: str


_FRONT_MSG = Hello | Submit | Cancel | Bye
_CORE_MSG = Ready | Step | Failed

_encoder = msgspec.msgpack.Encoder()
_core_decoder = msgspec.msgpack.Decoder(_FRONT_MSG)
_front_decoder = msgspec.msgpack.Decoder(_CORE_MSG)


def encode(msg: Any) -> bytes:
    """MessagePack bytes of one message."""
    return _encoder.encode(msg)


def decode_core(b: bytes) -> Hello | Submit | Cancel | Bye:
    """A message a core receives (raises ``msgspec.DecodeError`` / ``ValidationError`` on a
    malformed one)."""
    return _core_decoder.decode(b)


def decode_front(b: bytes) -> Ready | Step | Failed:
    """A message a front receives."""
    return _front_decoder.decode(b)
