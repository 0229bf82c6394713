"""``python -m deviceops.nn.serve``: an OpenAI-compatible HTTP server (uvicorn + Starlette).

Usage::

    python -m deviceops.nn.serve --model smollm2 [--host 127.0.0.1] [--port 8000]
        [--device cpu|cuda] [--dtype float16] [--max-batch 32] [--max-seq 2048]
        [--max-queue N] [--drain-timeout 10]

Routes and errors: :mod:`deviceops.nn._http`. The server listens at once and loads the
model in a worker thread (``/health`` is 503 until it is ready). SIGTERM or SIGINT stops
accepting connections, answers 503 to new requests on open connections, lets in-flight
generations finish for up to ``--drain-timeout`` seconds, then cancels the rest (freeing
their KV slots) and exits with status 0.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import signal
import sys
from collections.abc import Sequence
from types import FrameType
from typing import Any

import uvicorn

from ._engine import Engine
from ._http import create_app

__all__ = ["load_engine", "main"]

log = logging.getLogger("deviceops.nn.serve")


def load_engine(model: str = "smollm2", *, device: str | int | None = None, dtype: str | None = None,
                max_batch: int = 32, max_seq: int = 2048, max_queue: int | None = None,
                prefill_chunk: int = 512) -> Engine:
    """Load ``model`` (``"smollm2"`` or a ``.gguf`` path) and wrap it in an :class:`Engine`.

    ``dtype`` ``None``: the model's default (float16 on CUDA, float32 on the cpu backend).
    The model's KV cache is allocated for ``max_batch`` rows of ``max_seq`` positions.
    """
    import importlib

    import deviceops

    dev = deviceops.device(device) if device is not None else deviceops.default_device()
    nnx: Any = importlib.import_module("deviceops.nn")
    if not hasattr(nnx, "smollm2"):  # the loaders before deviceops.nn exported them
        nnx = importlib.import_module("deviceops.nn.load")
    # the model's KV cache is sized for the engine (its defaults are small on cpu)
    kw: dict[str, Any] = {"dtype": dtype, "device": dev, "max_batch": max_batch,
                          "max_seq": max_seq}
    if model == "smollm2":
        lm = nnx.smollm2(**kw)
    elif model.endswith(".gguf") and os.path.exists(model):
        lm = nnx.load_gguf(model, **kw)
    else:
        raise ValueError(f"serve: unknown model {model!r} (use 'smollm2' or a path to a .gguf file)")
    # every decode bucket's and prefill length's graph is captured now, not in a request's
    # step (Engine does it at construction)
    engine = Engine(lm, max_batch=max_batch, max_seq=max_seq, max_queue=max_queue,
                    prefill_chunk=prefill_chunk)
    gc.collect()
    gc.freeze()  # a full cyclic GC would otherwise walk the start-up heap mid-step
    return engine


class _Server(uvicorn.Server):
    """uvicorn's server; a shutdown signal also marks the app as draining (503s)."""

    def __init__(self, config: uvicorn.Config, app: Any) -> None:
        super().__init__(config)
        self._app = app

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self._app.state.serve.draining = True
        super().handle_exit(sig, frame)
        captured = getattr(self, "_captured_signals", None)
        if sig == signal.SIGTERM and isinstance(captured, list) and sig in captured:
            # uvicorn re-raises a captured signal after the graceful shutdown (exit status
            # -15); a drained SIGTERM is a clean stop here: status 0
            captured.remove(sig)


def main(argv: Sequence[str] | None = None) -> int:
    """Parse arguments, start uvicorn, serve until SIGTERM/SIGINT; 0 on a clean exit."""
    p = argparse.ArgumentParser(prog="python -m deviceops.nn.serve",
                                description="OpenAI-compatible server for deviceops.nn models")
    p.add_argument("--model", default="smollm2", help="'smollm2' or a path to a .gguf file")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--device", choices=["cpu", "cuda"], default=None,
                   help="backend (default: CUDA 0 if a GPU answers, else cpu)")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default=None)
    p.add_argument("--max-batch", type=int, default=32, help="concurrent generations (KV slots)")
    p.add_argument("--max-seq", type=int, default=2048, help="context per request")
    p.add_argument("--max-queue", type=int, default=None,
                   help="requests waiting for a slot before 429 (default 4 * max-batch)")
    p.add_argument("--prefill-chunk", type=int, default=512)
    p.add_argument("--drain-timeout", type=float, default=10.0,
                   help="seconds in-flight requests may finish after SIGTERM")
    p.add_argument("--log-level", default="info")
    args = p.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    device: str | int | None = None if args.device is None else (
        "cpu" if args.device == "cpu" else 0)

    def load() -> Engine:
        return load_engine(args.model, device=device, dtype=args.dtype,
                           max_batch=args.max_batch, max_seq=args.max_seq,
                           max_queue=args.max_queue, prefill_chunk=args.prefill_chunk)

    name = "smollm2" if args.model == "smollm2" else os.path.basename(args.model)
    app = create_app(load, model_name=name)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=args.drain_timeout, access_log=False)
    server = _Server(config, app)
    server.run()
    log.info("server stopped")
    return 0 if server.started else 1


if __name__ == "__main__":
    sys.exit(main())
