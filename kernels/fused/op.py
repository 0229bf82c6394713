"""A whole decode step of a Llama-family model in one persistent kernel.

:class:`FusedDecodeModel` packs a model's projections once (:mod:`._plan`: tensor-core
fragment order, the RoPE and SwiGLU pairs on one strip) into one device buffer, owns the
kernel's workspace, and makes the step op::

    model = FusedDecodeModel(stream, embed=table, layers=[FusedLayer(...), ...],
                             norm=w_norm, head=w_head, n_heads=9, n_kv_heads=3, head_dim=64,
                             eps=1e-5, theta=1e5, max_batch=32)
    model.step(b, state=state, table=table, k_cache=ks, v_cache=vs, logits=logits)

``step`` returns a DeviceOp that, for the first ``b`` cache rows, reads each row's token and
position from ``state`` (``(5, max_batch)`` int32: start, kv_len, inc, tokens, live; the
runner's :class:`~deviceops.nn.runner.rows.RowState` layout), embeds it, runs every layer
(RMSNorm, QKV + bias, RoPE, paged KV write at ``start``, attention over ``kv_len`` keys
through ``table``, O, residual, RMSNorm, gate/up + SwiGLU, down, residual), the final norm
and the LM head, and writes ``logits[:b]``. It is what the unfused ops compute, rounded at
the same points (so the two agree up to float32 summation order); sampling stays a separate
kernel.

CUDA: one cooperative launch of ``fused_decode.cu`` (one block per SM, grid-wide barriers
between phases; its header comment has the phases). It can be captured into a CUDA graph.
The ``cpu`` backend runs :mod:`._cpu`, which unpacks the same buffer (so the packing is
tested without a GPU).

Limits (checked when the model is built, :func:`fused_decode_support`): float16 or bfloat16;
``head_dim`` 64 or 128; hidden, FFN and vocabulary sizes multiples of 16; at most 8 query
heads per kv head; ``b`` at most :data:`MAX_ROWS`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from deviceops import Stream, api
from deviceops.extend import DeviceOp, ExecutionContext, ShapeError, Tensor, launch

from ._plan import gate_up_order, pack_strips, qkv_order

__all__ = ["MAX_ROWS", "FusedDecodeModel", "FusedLayer", "fused_decode_support", "phase_plan"]

#: The most rows one fused step computes (the tensor-core N dimension: 4 tiles of 8).
MAX_ROWS = 32
#: Key splits per (row, kv head) (``FD_MAX_SPLITS`` in the kernel).
MAX_SPLITS = 64
_GMAX = 8
_THREADS = 256
_WARPS = 8


@dataclass
class FusedLayer:
    """One decoder layer's host weights in Hugging Face layout (``(out, in)`` rows).

    Attributes:
        qkv: ``((Hq + 2 Hkv) D, hidden)``, the q, k and v projections stacked.
        o: ``(hidden, Hq D)``.
        gate_up: ``(2 F, hidden)``, gate rows then up rows.
        down: ``(hidden, F)``.
        norm1, norm2: ``(hidden,)`` RMSNorm scales (before attention, before the MLP).
        qkv_bias, o_bias, gate_up_bias, down_bias: optional biases of the projections.
    """

    qkv: np.ndarray
    o: np.ndarray
    gate_up: np.ndarray
    down: np.ndarray
    norm1: np.ndarray
    norm2: np.ndarray
    qkv_bias: np.ndarray | None = None
    o_bias: np.ndarray | None = None
    gate_up_bias: np.ndarray | None = None
    down_bias: np.ndarray | None = None


def fused_decode_support(*, hidden: int, ffn: int, vocab: int, n_heads: int, n_kv_heads: int,
                         head_dim: int, dtype: Any) -> str | None:
    """Why a model cannot run :class:`FusedDecodeModel`, or ``None`` when it can."""
    dt = np.dtype(dtype)
    if dt.itemsize != 2 or dt.kind not in "fV":
        return f"dtype {dt} (float16 or bfloat16 only)"
    if head_dim not in (64, 128):
        return f"head_dim={head_dim} (64 or 128 only)"
    for name, v in (("hidden_size", hidden), ("intermediate_size", ffn), ("vocab_size", vocab)):
        if v % 16:
            return f"{name}={v} is not a multiple of 16"
    if n_heads % n_kv_heads or n_heads // n_kv_heads > _GMAX:
        return f"{n_heads} query heads over {n_kv_heads} kv heads (at most {_GMAX} per kv head)"
    return None


def _pow2_floor(x: int) -> int:
    return 1 << max(0, int(x).bit_length() - 1)


def _wps(items: int, ksteps_per_item: int, warps: int) -> int:
    """Warps per item: enough to give every warp of the grid work, at most 8, at most one
    per k-step."""
    want = _pow2_floor(max(1, warps // max(items, 1)))
    return max(1, min(8, want, _pow2_floor(ksteps_per_item)))


def phase_plan(*, blocks: int, hidden: int, ffn: int, vocab: int, n_heads: int, n_kv_heads: int,
               head_dim: int) -> dict[str, int]:
    """K splits (``ks_o``, ``ks_d``: float32 partials summed by the next phase; one each, so
    the next norm reads them with the residual in one round trip; the kernel takes more) and
    warps per item (``wps_*``) of each projection, for a grid of ``blocks`` blocks of 8
    warps."""
    warps = blocks * _WARPS
    k_h, k_q, k_f = hidden // 16, n_heads * head_dim // 16, ffn // 16
    s_qkv, s_h, s_gu, s_v = (n_heads + 2 * n_kv_heads) * head_dim // 16, hidden // 16, ffn // 8, vocab // 16
    # one partial each (rounded by the next norm, read with the residual in one round trip)
    ks_o = ks_d = 1
    return {
        "ks_o": ks_o, "ks_d": ks_d,
        "wps_qkv": _wps(s_qkv, k_h, warps),
        "wps_o": _wps(s_h * ks_o, k_q // ks_o, warps),
        "wps_gu": _wps(s_gu, k_h, warps),
        "wps_d": _wps(s_h * ks_d, k_f // ks_d, warps),
        "wps_head": _wps(s_v, k_h, warps),
    }


def _align(n: int, a: int = 8) -> int:
    return -(-n // a) * a


class _Packer:
    """Lays host arrays into one flat buffer at 16-byte aligned offsets (in elements)."""

    def __init__(self, dtype: np.dtype[Any]) -> None:
        self.dtype = dtype
        self.parts: list[np.ndarray] = []
        self.size = 0

    def add(self, a: np.ndarray | None) -> int:
        if a is None:
            return -1
        flat = np.ascontiguousarray(a, dtype=self.dtype).reshape(-1)
        off = self.size
        self.parts.append(flat)
        pad = _align(flat.size) - flat.size
        if pad:
            self.parts.append(np.zeros(pad, self.dtype))
        self.size += flat.size + pad
        return off

    def join(self) -> np.ndarray:
        return np.concatenate(self.parts) if self.parts else np.zeros(8, self.dtype)


# FdParams (fused_decode.cu): every field 8 bytes
_PARAMS = ("layers", "n_layers", "embed", "w_head", "norm_f", "state", "stride", "table", "mb",
           "nb", "bs", "logits", "r0", "r1", "q", "att", "act", "part", "attp", "bar", "done",
           "B", "H", "Hq", "Hkv", "F", "V", "KP", "eps", "log2_theta", "scale_log2", "ks_o",
           "ks_d", "wps_qkv", "wps_o", "wps_gu", "wps_d", "wps_head", "ticks", "detail", "variant")
_FLOAT_PARAMS = {"eps", "log2_theta", "scale_log2"}
# FdLayer: 12 pointers
_LAYER = ("wqkv", "wo", "wgu", "wd", "bqkv", "bo", "bgu", "bd", "n1", "n2", "kc", "vc")


class FusedDecodeModel:
    """A model's weights packed for the fused decode kernel, and its workspace (module
    docstring).

    Args:
        stream: where the buffers are allocated and uploaded (now, synchronously).
        embed: the token table ``(vocab, hidden)`` on the device (read as it is).
        layers: the host weights of every layer.
        norm: the final RMSNorm scale ``(hidden,)``.
        head: the LM head ``(vocab, hidden)`` (the embedding table's values when tied).
        n_heads, n_kv_heads, head_dim, eps, theta: the architecture.
        max_batch: the rows of the runner's state (its ``stride``); steps take ``b <=
            min(max_batch, MAX_ROWS)`` rows.
        blocks: grid size (default: one block per SM of the stream's device; 8 on ``cpu``).

    Raises:
        ValueError: the model is outside :func:`fused_decode_support`'s limits.
    """

    #: The most rows one step takes (:data:`MAX_ROWS`).
    MAX_ROWS = MAX_ROWS

    @staticmethod
    def support(**shapes: Any) -> str | None:
        """:func:`fused_decode_support`: why a model cannot run fused, or ``None``."""
        return fused_decode_support(**shapes)

    def __init__(self, stream: Stream, *, embed: Tensor, layers: Sequence[FusedLayer],
                 norm: np.ndarray, head: np.ndarray, n_heads: int, n_kv_heads: int,
                 head_dim: int, eps: float, theta: float, max_batch: int,
                 blocks: int | None = None) -> None:
        vocab, hidden = (int(x) for x in embed.shape)
        ffn = int(layers[0].down.shape[1]) if layers else 16
        why = fused_decode_support(hidden=hidden, ffn=ffn, vocab=vocab, n_heads=n_heads,
                                   n_kv_heads=n_kv_heads, head_dim=head_dim, dtype=embed.dtype)
        if why is not None:
            raise ValueError(f"fused_decode: this model cannot run fused: {why}")
        self.stream = stream
        self.device = stream.device
        self.dtype = np.dtype(embed.dtype)
        self.embed = embed
        self.hidden, self.ffn, self.vocab = hidden, ffn, vocab
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.eps, self.theta = float(eps), float(theta)
        self.max_batch = max_batch
        self.n_layers = len(layers)
        if blocks is None:
            blocks = 8 if self.device.is_cpu else _sm_count(self.device.index)
        self.blocks = blocks
        self.plan = phase_plan(blocks=blocks, hidden=hidden, ffn=ffn, vocab=vocab, n_heads=n_heads,
                               n_kv_heads=n_kv_heads, head_dim=head_dim)
        qkv_rows = (n_heads + 2 * n_kv_heads) * head_dim
        p = _Packer(self.dtype)
        self.offsets: list[dict[str, int]] = []
        oq, og = qkv_order(n_heads, n_kv_heads, head_dim), gate_up_order(ffn)
        for i, ly in enumerate(layers):
            for name, a, shape in (("qkv", ly.qkv, (qkv_rows, hidden)), ("o", ly.o, (hidden, n_heads * head_dim)),
                                   ("gate_up", ly.gate_up, (2 * ffn, hidden)), ("down", ly.down, (hidden, ffn))):
                if tuple(a.shape) != shape:
                    raise ShapeError(f"fused_decode: layer {i} {name} has shape {tuple(a.shape)}; "
                                     f"expected {shape}", op="fused_decode")
            self.offsets.append({
                "wqkv": p.add(pack_strips(np.asarray(ly.qkv), oq)),
                "wo": p.add(pack_strips(np.asarray(ly.o))),
                "wgu": p.add(pack_strips(np.asarray(ly.gate_up), og)),
                "wd": p.add(pack_strips(np.asarray(ly.down))),
                "bqkv": p.add(ly.qkv_bias), "bo": p.add(ly.o_bias),
                "bgu": p.add(ly.gate_up_bias), "bd": p.add(ly.down_bias),
                "n1": p.add(ly.norm1), "n2": p.add(ly.norm2),
            })
        if tuple(head.shape) != (vocab, hidden):
            raise ShapeError(f"fused_decode: head has shape {tuple(head.shape)}; expected "
                             f"{(vocab, hidden)}", op="fused_decode")
        self.off_head = p.add(pack_strips(np.asarray(head)))
        self.off_norm = p.add(norm)
        self.packed = api.from_host(p.join()).sync_on(stream)
        # workspace
        n, hq = max_batch, n_heads * head_dim
        ks = max(self.plan["ks_o"], self.plan["ks_d"])

        def buf(size: int, dtype: Any) -> Tensor:
            return api.zeros((max(size, 8),), dtype).sync_on(stream)

        self.r0, self.r1 = buf(n * hidden, self.dtype), buf(n * hidden, self.dtype)
        self.q, self.att = buf(n * hq, self.dtype), buf(n * hq, self.dtype)
        self.act = buf(n * ffn, self.dtype)
        self.part = buf(ks * n * hidden, "float32")
        self.attp = buf(n * n_heads * MAX_SPLITS * (head_dim + 2), "float32")
        # the grid barrier's word, then (a line further) the attention splits' done counters
        self._done_at = 32
        self.counters = buf(self._done_at + n * n_kv_heads, "int32")
        kmax = max(hidden, hq, ffn)
        self.kp = _align(kmax, 64) + 8  # tile row stride: conflict-free fragment reads
        self._steps: dict[tuple[Any, ...], Any] = {}
        #: (the cpu backend's step: the float32 weights unpacked from :attr:`packed`, once)
        self.cpu_unpacked: dict[str, Any] | None = None
        #: Profiling: an int64 tensor of at least ``5 * layers + 3`` elements set before the
        #: first step makes block 0 write its clock (ns): at the start, after 64 barriers,
        #: after every phase's barrier, at the end; with ``8 * layers + 3``, also three
        #: ticks inside each O-projection phase (``None``: off).
        self.ticks: Tensor | None = None
        #: Timing experiments only (``FD_SKIP_*`` in fused_decode.cu: parts of every phase left
        #: out, or every barrier doubled; the logits are then wrong). Set before the first step.
        self.variant = 0

    @property
    def nbytes(self) -> int:
        """Device bytes held: the packed weights and the workspace."""
        return sum(t.nbytes for t in (self.packed, self.r0, self.r1, self.q, self.att, self.act,
                                      self.part, self.attp, self.counters))

    def smem_bytes(self, b: int) -> int:
        """Dynamic shared memory of a step over ``b`` rows."""
        nt = _n_tiles(b)
        return (8 * nt * self.kp * 2 + _WARPS * nt * 4 * 32 * 4 + _WARPS * _GMAX * self.head_dim * 4
                + _WARPS * 32 * self.head_dim * 2)

    def step(self, b: int, *, state: Tensor, table: Tensor, k_cache: Sequence[Tensor],
             v_cache: Sequence[Tensor], logits: Tensor) -> DeviceOp[Tensor]:
        """The op of one decode step over rows ``0 .. b-1`` (module docstring); produces
        ``logits``.

        Raises:
            ValueError, ShapeError: ``b`` or a buffer does not fit (before any launch).
        """
        if not 1 <= b <= min(self.max_batch, MAX_ROWS):
            raise ValueError(f"fused_decode: b={b} rows; expected 1..{min(self.max_batch, MAX_ROWS)}")
        if tuple(state.shape) != (5, self.max_batch) or state.dtype != np.dtype("int32"):
            raise ShapeError(f"fused_decode: state is {state.dtype} {tuple(state.shape)}; expected "
                             f"int32 (5, {self.max_batch})", op="fused_decode")
        if table.ndim != 2 or table.shape[0] < b:
            raise ShapeError(f"fused_decode: table has shape {tuple(table.shape)}; expected "
                             f"(>= {b}, max_blocks)", op="fused_decode")
        if len(k_cache) != self.n_layers or len(v_cache) != self.n_layers:
            raise ValueError(f"fused_decode: {len(k_cache)} key and {len(v_cache)} value caches "
                             f"for {self.n_layers} layers")
        want = (self.n_kv_heads, self.head_dim)
        for t in (*k_cache, *v_cache):
            if t.ndim != 4 or (t.shape[1], t.shape[3]) != want or t.dtype != self.dtype:
                raise ShapeError(f"fused_decode: a cache is {t.dtype} {tuple(t.shape)}; expected "
                                 f"{self.dtype} (blocks, {want[0]}, block_size, {want[1]})",
                                 op="fused_decode")
        if tuple(logits.shape) != (b, self.vocab) or logits.dtype != self.dtype:
            raise ShapeError(f"fused_decode: logits is {logits.dtype} {tuple(logits.shape)}; "
                             f"expected {self.dtype} {(b, self.vocab)}", op="fused_decode")
        kc, vc = list(k_cache), list(v_cache)
        if not self.device.is_cpu:
            self.params(b, state, table, kc, vc, logits)  # (uploads once per set of buffers)
        return _StepOp(self, b, state, table, kc, vc, logits)

    def prepare(self, b: int, *, state: Tensor, table: Tensor, k_cache: Sequence[Tensor],
                v_cache: Sequence[Tensor], logits: Tensor) -> None:
        """Upload the launch records of :meth:`step` with these buffers now (synchronously),
        so that a ``step`` built later inside another op's execution (a ``then`` closure, a
        graph capture) finds them: uploading there is refused."""
        self.step(b, state=state, table=table, k_cache=k_cache, v_cache=v_cache,
                  logits=logits)._consume()

    # -- launch records --------------------------------------------------------------------
    def params(self, b: int, state: Tensor, table: Tensor, kc: list[Tensor], vc: list[Tensor],
               logits: Tensor) -> tuple[Tensor, Tensor]:
        """The kernel's parameter record and layer table on the device (built once per set
        of buffers)."""
        key = (b, id(state), id(table), id(logits), *map(id, kc), *map(id, vc))
        got = self._steps.get(key)
        if got is not None:
            return got[0], got[1]
        base = _ptr(self.packed)
        item = self.dtype.itemsize

        def at(off: int) -> int:
            return 0 if off < 0 else base + off * item

        rows = np.zeros((self.n_layers, len(_LAYER)), np.uint64)
        for i, off in enumerate(self.offsets):
            vals = [at(off[k]) for k in _LAYER[:10]] + [_ptr(kc[i]), _ptr(vc[i])]
            rows[i] = vals
        layers_t = api.from_host(rows.reshape(-1).view(np.int64)).sync_on(self.stream)
        ctr = _ptr(self.counters)
        v: dict[str, Any] = {
            "layers": _ptr(layers_t), "n_layers": self.n_layers, "embed": _ptr(self.embed),
            "w_head": at(self.off_head), "norm_f": at(self.off_norm), "state": _ptr(state),
            "stride": self.max_batch, "table": _ptr(table), "mb": int(table.shape[1]),
            "nb": int(kc[0].shape[0]), "bs": int(kc[0].shape[2]), "logits": _ptr(logits),
            "r0": _ptr(self.r0), "r1": _ptr(self.r1), "q": _ptr(self.q), "att": _ptr(self.att),
            "act": _ptr(self.act), "part": _ptr(self.part), "attp": _ptr(self.attp), "bar": ctr,
            "done": ctr + 4 * self._done_at, "B": b, "H": self.hidden, "Hq": self.n_heads, "Hkv": self.n_kv_heads,
            "F": self.ffn, "V": self.vocab, "KP": self.kp, "eps": self.eps,
            "log2_theta": math.log2(self.theta),
            "scale_log2": math.log2(math.e) / math.sqrt(self.head_dim), **self.plan,
            "ticks": 0 if self.ticks is None else _ptr(self.ticks),
            "detail": int(self.ticks is not None and self.ticks.shape[0] >= 8 * self.n_layers + 3),
            "variant": self.variant,
        }
        rec = np.zeros(len(_PARAMS), np.uint64)
        for i, k in enumerate(_PARAMS):
            x = v[k]
            rec[i] = np.float64(x).view(np.uint64) if k in _FLOAT_PARAMS else np.uint64(int(x))
        params_t = api.from_host(rec.view(np.int64)).sync_on(self.stream)
        # (the buffers are kept with their record, so the ids of the key stay theirs)
        self._steps[key] = (params_t, layers_t, (state, table, logits, kc, vc))
        return params_t, layers_t


def _n_tiles(b: int) -> int:
    return 1 if b <= 8 else 2 if b <= 16 else 4


def _ptr(t: Tensor) -> int:
    """The device address of ``t``'s first element (a CUDA tensor's)."""
    return int(t.array.data.ptr)


def _sm_count(index: int) -> int:
    import cupy

    return int(cupy.cuda.Device(index).attributes["MultiProcessorCount"])


class _StepOp(DeviceOp[Tensor]):
    """One fused decode step (see :meth:`FusedDecodeModel.step`)."""

    __slots__ = ("_b", "_kc", "_logits", "_m", "_rows", "_table", "_vc")

    def __init__(self, m: FusedDecodeModel, b: int, state: Tensor, table: Tensor,
                 kc: list[Tensor], vc: list[Tensor], logits: Tensor) -> None:
        super().__init__()
        self._m, self._b, self._rows, self._table = m, b, state, table
        self._kc, self._vc, self._logits = kc, vc, logits

    def _describe(self) -> str:
        return f"fused_decode(b={self._b})"

    def _inputs(self) -> tuple[Tensor, ...]:
        return (self._rows, self._table, self._logits)

    def _execute(self, ctx: ExecutionContext) -> Tensor:
        m, b = self._m, self._b
        if ctx.device != m.device:
            raise ValueError(f"fused_decode: the op is executing on {ctx.device}, but the model's "
                             f"buffers are on {m.device}; run it on the runner's stream")
        reads = [m.packed, m.embed, self._rows, self._table]
        writes = [self._logits, *self._kc, *self._vc, m.r0, m.r1, m.q, m.att, m.act, m.part,
                  m.attp, m.counters]
        if ctx.device.is_cpu:
            from ._cpu import fused_decode_cpu

            st, tb, kc, vc, lg = self._rows, self._table, self._kc, self._vc, self._logits

            def cpu() -> None:
                fused_decode_cpu(m, b, st.array, tb.array, [t.array for t in kc],
                                 [t.array for t in vc], lg.array)

            launch(ctx, "fused_decode", reads, writes, cpu, _no_cuda)
            return self._logits
        params, layers = m.params(b, self._rows, self._table, self._kc, self._vc, self._logits)
        from ._cuda import launch_fused

        def cuda(native: Any) -> None:
            launch_fused(m, b, params, native)

        launch(ctx, "fused_decode", [*reads, params, layers], writes, _no_cpu, cuda)
        return self._logits


def _no_cuda(native: Any) -> None:
    raise RuntimeError("fused_decode: the cpu half was asked for a CUDA launch")


def _no_cpu() -> None:
    raise RuntimeError("fused_decode: the CUDA half was asked to run on the cpu backend")
