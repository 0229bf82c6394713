"""A greedy decode loop captured once as a CUDA graph and replayed per token.

One decode step of a toy language model, written as one lazy DeviceOp over
preallocated buffers::

    token (1,) int32 -> embedding -> x (1, H)
    repeat L times:  h = gelu(x @ W + b);  h = rms_norm(h);  x = x + h
    logits = x @ W_out + b_out   (1, V)  ->  argmax  -> next (1,) int32

Every tensor is allocated before capture; ``step().graph_on(stream)`` captures the
whole step once. Per token the loop then feeds the previous choice back with
``graph.update(api.memcpy(token, next))``, replays with ``graph.launch()`` (one driver
call on a GPU) and reads the chosen token. The same step run eagerly (a fresh DeviceOp
per token) must choose the same tokens and produce the same logits, and the logits must
match a float64 NumPy model fed the same tokens. Prints per-token times of both.

Run:  python examples/graph_decode_loop.py [--device cpu|cuda] [--tokens 16]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from typing import Any

import ml_dtypes
import numpy as np

import deviceops
from deviceops import Tensor, api, kernels

TOL = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 4e-2}  # ||logits - ref|| / ||ref||


def np_dtype(name: str) -> np.dtype[Any]:
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


class Model:
    """Host weights, their device copies, and the preallocated activation buffers."""

    def __init__(self, stream: deviceops.Stream, vocab: int, hidden: int, layers: int,
                 dtype: str, seed: int) -> None:
        rng = np.random.default_rng(seed)
        dt = np_dtype(dtype)

        def w(shape: tuple[int, ...], scale: float, offset: float = 0.0) -> np.ndarray:
            return (offset + scale * rng.standard_normal(shape)).astype(dt)

        self.h_table = w((vocab, hidden), 1.0)
        self.h_layers = [(w((hidden, hidden), 1 / math.sqrt(hidden)), w((hidden,), 0.1), w((hidden,), 0.1, 1.0))
                         for _ in range(layers)]
        self.h_out = (w((hidden, vocab), 2 / math.sqrt(hidden)), w((vocab,), 0.1))

        def up(a: np.ndarray) -> Tensor:
            return api.from_host(a).sync_on(stream)

        self.table = up(self.h_table)
        self.layers = [(up(wl), up(bl), up(gl)) for wl, bl, gl in self.h_layers]
        self.w_out, self.b_out = up(self.h_out[0]), up(self.h_out[1])
        # activations and the token buffers: allocated once, before any capture
        self.token = api.zeros((1,), "int32").sync_on(stream)
        self.next = api.zeros((1,), "int32").sync_on(stream)
        self.x = api.zeros((1, hidden), dtype).sync_on(stream)
        self.h = api.zeros((1, hidden), dtype).sync_on(stream)
        self.logits = api.zeros((1, vocab), dtype).sync_on(stream)

    def step(self) -> deviceops.DeviceOp[Any]:
        """One decode step (a fresh lazy op each call): ``token`` -> ``next``, ``logits``."""
        x: Any = kernels.embedding(self.token, self.table, out=self.x)
        for w, b, g in self.layers:
            h = kernels.gemm(x, w, out=self.h, bias=b, activation="gelu")
            h = kernels.rms_norm(h, g, out=self.h)
            x = kernels.add(self.x, h, out=self.x)
        logits = kernels.gemm(x, self.w_out, out=self.logits, bias=self.b_out)
        return kernels.argmax(logits, out=self.next)

    def reference_logits(self, token: int) -> np.ndarray:
        """The same step in float64 NumPy."""
        x = self.h_table[token].astype(np.float64)[None]
        for w, b, g in self.h_layers:
            v = x @ w.astype(np.float64) + b.astype(np.float64)
            v = 0.5 * v * (1 + np.tanh(math.sqrt(2 / math.pi) * (v + 0.044715 * v**3)))
            v = v / np.sqrt((v * v).mean(-1, keepdims=True) + 1e-6) * g.astype(np.float64)
            x = x + v
        return np.asarray(x @ self.h_out[0].astype(np.float64) + self.h_out[1].astype(np.float64))[0]


def decode(model: Model, stream: deviceops.Stream, first: int, n: int,
           run_step: Any) -> tuple[list[int], list[np.ndarray], list[float]]:
    """Greedy-decode ``n`` tokens; ``run_step()`` enqueues one step reading ``model.next``."""
    api.memcpy(model.next, api.from_host(np.array([first], np.int32)).sync_on(stream)).sync_on(stream)
    tokens, logits, times = [], [], []
    for _ in range(n):
        t0 = time.perf_counter()
        run_step()  # token <- next; step
        tok = int(model.next.to_host().sync_on(stream)[0])
        times.append(time.perf_counter() - t0)
        tokens.append(tok)
        logits.append(np.asarray(model.logits.to_host().sync_on(stream)[0]).astype(np.float64))
    return tokens, logits, times


def main(argv: list[str] | None = None) -> int:
    """Run eager and graph decoding, check them against each other and NumPy; 0 on success."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--device", choices=["cpu", "cuda"], default=None,
                   help="backend (default: the default device)")
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--dtype", choices=sorted(TOL), default="float32")
    p.add_argument("--first-token", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    dev = deviceops.device(args.device) if args.device else deviceops.default_device()
    stream = dev.new_stream()
    model = Model(stream, args.vocab, args.hidden, args.layers, args.dtype, args.seed)
    print(f"device {dev}, vocab {args.vocab}, hidden {args.hidden}, layers {args.layers}, "
          f"{args.dtype}, {args.tokens} tokens")

    # Warm-up on the capture stream: compiles kernels, sizes the stream's GEMM workspace
    # (it cannot grow inside a capture).
    api.memcpy(model.token, model.next).then(lambda _: model.step()).sync_on(stream)

    def eager_step() -> None:
        api.memcpy(model.token, model.next).then(lambda _: model.step()).async_on(stream)

    e_tok, e_logits, e_times = decode(model, stream, args.first_token, args.tokens, eager_step)

    graph = model.step().graph_on(stream)
    assert graph.take_output() is model.next

    def graph_step() -> None:
        graph.update(api.memcpy(model.token, model.next))
        graph.launch()

    g_tok, g_logits, g_times = decode(model, stream, args.first_token, args.tokens, graph_step)

    # checks: graph == eager; the kernels' argmax agrees with their logits; NumPy agrees
    assert g_tok == e_tok, f"graph tokens {g_tok} != eager tokens {e_tok}"
    fed = [args.first_token, *e_tok[:-1]]
    for i, (tok, el, gl) in enumerate(zip(e_tok, e_logits, g_logits, strict=True)):
        np.testing.assert_allclose(gl, el, rtol=1e-6, atol=1e-6, err_msg=f"token {i}: graph vs eager logits")
        assert int(np.argmax(el)) == tok, f"token {i}: argmax kernel chose {tok}, logits say {np.argmax(el)}"
        ref = model.reference_logits(fed[i])
        err = float(np.linalg.norm(el - ref) / np.linalg.norm(ref))
        assert err < TOL[args.dtype], f"token {i}: logits differ from float64 NumPy by {err:.2e}"

    e_ms, g_ms = statistics.median(e_times) * 1e3, statistics.median(g_times) * 1e3
    print(f"tokens: {e_tok}")
    print(f"eager : {e_ms:8.3f} ms/token (median, incl. reading the token)")
    print(f"graph : {g_ms:8.3f} ms/token (median, incl. reading the token), {graph.launches} replays")
    print(f"eager / graph = {e_ms / g_ms:.2f}x; tokens and logits agree, logits match float64 NumPy: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
