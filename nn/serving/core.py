"""The engine core: one device's :class:`~deviceops.nn.Engine` in its own process, driven by
its step loop and spoken to over ZeroMQ (:mod:`.protocol`).

``python -m deviceops.nn.serving.core --address ipc://... --spec '{json}'`` loads the model
(:class:`CoreSpec`), binds a ``ROUTER`` socket at the address and runs two tasks on one
asyncio loop:

* **receive**: fronts' :class:`~.protocol.Submit` / :class:`~.protocol.Cancel` /
  :class:`~.protocol.Bye` / :class:`~.protocol.Hello` messages, each handled at once
  (a submit is checked and queued in the engine, or finished with its error);
* **step**: while the engine has work, one engine step (admit, decode, prefill; the GPU
  work is awaited, so messages keep arriving meanwhile), then one
  :class:`~.protocol.Step` message per front with news: new token ids as arrays, finished
  requests, log-probabilities when asked, stats and phase times. Idle, it waits for a
  message.

No HTTP, no JSON, no tokenising and no detokenising happen here: the front does them
(:mod:`.core_client`, :mod:`.http`).

**Overlap.** A step's tokens are sent while the next step runs on the device. With the
engine's lookahead (the default for a ``CausalLM``) a step enqueues its work and then
delivers the previous step's tokens, so the core sends them as soon as the step returns,
the device busy with the step just enqueued; without it the core sends them right after the
next step's work is enqueued (the scheduler's ``on_enqueued``). Either way encoding and
sending cost no device time; when no step follows, they go at once. Waiting for the
device, the core polls its event for up to :data:`CORE_SPIN_US` before parking (a
thread's wake-up costs more than a step's slack; ``DEVICEOPS_AWAIT_SPIN_US``, when set,
wins).

**Failure.** The engine is fail-stop. When a step fails, every request ends with kind
``"failed"``, each front gets :class:`~.protocol.Failed`, and the process exits with
status 1 a moment later so that its supervisor (:mod:`.core_process`) starts a fresh one
on a fresh device context. A model that cannot load exits with status 3 after writing the
one-line reason to ``--reason-file``. The core exits when its parent process does (it
checks every half second), so no core outlives ``serve``. SIGTERM: stop and exit 0 (the
supervisor sends it after the fronts have drained).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import gc
import json
import logging
import os
import pickle
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .protocol import (
    Bye,
    Cancel,
    Failed,
    Finish,
    Hello,
    Ready,
    Step,
    Submit,
    decode_core,
    encode,
    pack_i32,
    pack_i64,
    unpack_i32,
)
from .requests import (
    STAT_FIELDS,
    EngineClosed,
    EngineFailed,
    EngineOverloaded,
    RequestStream,
    _Request,
)

__all__ = ["CORE_SPIN_US", "EXIT_FAILED", "EXIT_LOAD", "CoreSpec", "EngineCore", "main",
           "remove_ipc_endpoint", "tune_await"]

log = logging.getLogger("deviceops.nn.core")

#: Exit status of a core whose engine failed (its supervisor restarts it).
EXIT_FAILED = 1
#: Exit status of a core whose model could not be loaded (not restarted).
EXIT_LOAD = 3
#: Microseconds a core's ``await`` polls the device before parking (module docstring).
CORE_SPIN_US = 3000.0
#: Seconds between fresh engine stats in the step messages (they walk every request).
STATS_EVERY_S = 0.01  # (and whenever the engine goes idle: the final figures are exact)
#: Seconds between the core's checks that its parent is still alive.
PARENT_CHECK_S = 0.5


@dataclass(frozen=True)
class CoreSpec:
    """What a core loads: the model (a name of ``serve``'s models or a ``.gguf`` path), the
    device (``"cuda:1"``, ``"cpu:1"``; ``None``: the default device), the engine's limits,
    prefix caching and the weights' form (``"expanded"``/``"native"``), as ``python -m
    deviceops.nn.serve`` takes them."""

    model: str = "smollm2"
    device: str | None = None
    dtype: str | None = None
    max_batch: int = 32
    max_seq: int = 2048
    max_queue: int | None = None
    prefill_chunk: int = 512
    prefix_cache: bool = True
    weights: str = "expanded"

    def to_json(self) -> str:
        """The spec as the ``--spec`` argument."""
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> CoreSpec:
        """The spec :meth:`to_json` wrote."""
        return cls(**json.loads(text))


def _kind(exc: BaseException) -> str:
    if isinstance(exc, EngineFailed):
        return "failed"
    if isinstance(exc, EngineOverloaded):
        return "overloaded"
    if isinstance(exc, EngineClosed):
        return "closed"
    if isinstance(exc, (ValueError, TypeError)):
        return "invalid"
    return "error"


def _message(exc: BaseException) -> str:
    if isinstance(exc, EngineFailed) and exc.__cause__ is not None:
        c = exc.__cause__
        return f"{type(c).__name__}: {c}"
    return str(exc)


class _Front:
    """One connected front: its requests here and the news not yet sent."""

    __slots__ = ("done", "ident", "news", "streams")

    def __init__(self, ident: bytes) -> None:
        self.ident = ident
        self.streams: dict[int, RequestStream] = {}  # front rid -> the engine's stream
        self.news: dict[int, _Request] = {}  # front rid -> request with news
        self.done: list[Finish] = []  # refused at submit


class EngineCore:
    """The step loop of one engine, serving the fronts connected to ``address``.

    Args:
        engine: a fail-stop :class:`~deviceops.nn.Engine` (built by :func:`main` from a
            :class:`CoreSpec`, or by a test).
        address: the ZeroMQ address to bind (``ipc:///tmp/x.sock``, ``tcp://127.0.0.1:0``).
        device: the device's name, reported in :class:`~.protocol.Ready`.
        on_failed: called once the engine failed and the fronts were told (default: exit
            the process with :data:`EXIT_FAILED` 0.2 s later, for the supervisor to restart
            it).

    Attributes:
        bound: the address actually bound (a ``tcp://...:0`` gets its port here).
    """

    def __init__(self, engine: Any, address: str, *, device: str = "",
                 on_failed: Callable[[], None] | None = None) -> None:
        self.engine = engine
        self.address = address
        self.on_failed = on_failed or _exit_soon
        self.bound = address
        self.device = device or str(getattr(engine.model, "device", "?"))
        self._fronts: dict[bytes, _Front] = {}
        self._owner: dict[int, tuple[_Front, int]] = {}  # engine request id -> (front, rid)
        self._wake = asyncio.Event()
        self._stop = asyncio.Event()
        self._bound = asyncio.Event()
        self._failed = False
        self._recv_s = 0.0
        self._send_s = 0.0
        self._sock: Any = None
        self._sent_in_step = False
        self._stats: list[int] = []
        self._stats_t = 0.0
        engine.listener = self._news
        if not engine.scheduler.lookahead:  # (lookahead: a step ends with the device busy)
            engine.scheduler.on_enqueued = self._overlapped_flush

    # -- info ---------------------------------------------------------------------------
    def info(self, full: bool) -> dict[str, Any]:
        """The :class:`~.protocol.Ready` payload (``full``: with the tokenizer side)."""
        eng = self.engine
        out: dict[str, Any] = {
            "vocab_size": eng.steps.vocab_size, "eos_ids": sorted(eng.steps.eos_ids),
            "max_seq": eng.max_seq, "max_batch": eng.max_batch, "max_queue": eng.max_queue,
            "features": sorted(eng.sampling_features), "device": self.device,
            "pid": os.getpid(), "kv_block_size": eng.pool.block_size,
            "kv_blocks_total": int(getattr(eng.steps, "kv_blocks_total", 0))
            if eng.scheduler.reserve is not None else 0,
        }
        if full:
            model = eng.model
            template = getattr(model, "chat_template", None)
            out |= {"tokenizer": model.tokenizer.to_str(),
                    "config": pickle.dumps(model.config),
                    "chat_template": None if template is None else template.source}
        return out

    # -- loop ---------------------------------------------------------------------------
    async def serve(self) -> None:
        """Bind, then receive and step until :meth:`stop` (or a failure)."""
        import zmq
        import zmq.asyncio

        ctx = zmq.asyncio.Context()
        sock = self._sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 0)  # a gone front's messages are dropped
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.bind(self.address)
        self.bound = sock.get_string(zmq.LAST_ENDPOINT)
        self._bound.set()
        tasks = [asyncio.ensure_future(self._receive()), asyncio.ensure_future(self._steps())]
        try:
            await self._stop.wait()
        finally:
            for t in tasks:
                t.cancel()
            for t in tasks:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t
            self.engine.close()
            sock.close(0)
            ctx.term()

    async def wait_bound(self) -> str:
        """Wait until :meth:`serve` (running in another task) has bound; the address."""
        await self._bound.wait()
        return self.bound

    def stop(self) -> None:
        """End :meth:`serve` (requests still running are cancelled)."""
        self._stop.set()

    async def _receive(self) -> None:
        sock = self._sock
        while True:
            ident, payload = await sock.recv_multipart(copy=True)
            t0 = time.perf_counter()
            try:
                msg = decode_core(payload)
            except Exception as exc:  # not ours: say so in the log, keep serving
                log.warning("dropping a malformed message from %r: %s", ident, exc)
                continue
            front = self._fronts.get(ident)
            if front is None:
                front = self._fronts[ident] = _Front(ident)
            if isinstance(msg, Submit):
                self._submit(front, msg)
            elif isinstance(msg, Cancel):
                for rid in msg.rids:
                    rs = front.streams.get(rid)
                    if rs is not None:
                        rs.cancel()
            elif isinstance(msg, Hello):
                await sock.send_multipart([ident, encode(Ready(self.info(msg.info)))])
            elif isinstance(msg, Bye):
                for rs in list(front.streams.values()):
                    rs.cancel()
                self._fronts.pop(ident, None)
            self._recv_s += time.perf_counter() - t0
            if not self.engine.scheduler.stepping:
                self._flush()  # refusals and cancellations answer at once when idle
            self._wake.set()

    def _submit(self, front: _Front, m: Submit) -> None:
        try:
            rs = self.engine.stream(
                unpack_i32(m.prompt), m.max_new, temperature=m.temperature, top_k=m.top_k,
                top_p=m.top_p, seed=m.seed, stop=m.stop or None, ignore_eos=m.ignore_eos,
                presence_penalty=m.presence_penalty, frequency_penalty=m.frequency_penalty,
                logit_bias=m.logit_bias, logprobs=m.logprobs, grammar=m.grammar)
        except Exception as exc:  # refused: the front's request ends with the reason
            front.done.append(Finish(m.rid, "error", _kind(exc), _message(exc)))
            if isinstance(exc, EngineFailed):
                self._engine_failed()
            return
        req = rs._req
        if req.finished:  # max_new_tokens 0: done at once
            front.done.append(Finish(m.rid, req.finish_reason or "length"))
            return
        front.streams[m.rid] = rs
        self._owner[req.id] = (front, m.rid)

    def _news(self, req: _Request) -> None:
        owner = self._owner.get(req.id)
        if owner is not None:
            owner[0].news[owner[1]] = req

    async def _steps(self) -> None:
        from deviceops import _env

        engine = self.engine
        pause = float(_env.get("DEVICEOPS_CORE_STEP_PAUSE_MS") or 0) / 1e3
        while True:
            if not engine.has_work:
                self._wake.clear()
                await self._wake.wait()
                continue
            self._sent_in_step = False
            await engine.run_step()
            if not self._sent_in_step or not engine.has_work:
                self._flush()  # else this step's news go out while the next one runs
            if engine.failure is not None:
                self._engine_failed()
            await asyncio.sleep(pause)  # the receiver queues what arrived during the step

    def _overlapped_flush(self) -> None:
        """The step's device work is enqueued: send the previous step's news meanwhile."""
        self._sent_in_step = True
        self._flush()

    def _flush(self) -> None:
        """Send each front its news: one :class:`~.protocol.Step` message per front."""
        t0 = time.perf_counter()
        if t0 - self._stats_t >= STATS_EVERY_S or not self.engine.has_work or not self._stats:
            st = self.engine.stats()
            self._stats = [getattr(st, f) for f in STAT_FIELDS]
            self._stats_t = t0
        stats = self._stats
        phases = [*self.engine.scheduler.phase_s.values(), self._recv_s, self._send_s]
        for front in list(self._fronts.values()):
            if not front.news and not front.done:
                continue
            rids: list[int] = []
            counts: list[int] = []
            tokens: list[int] = []
            done = front.done
            front.done = []
            lps: list[tuple[int, int, float, list[tuple[int, float]]]] | None = None
            for rid, req in front.news.items():
                buf = req.buf
                if buf:
                    n = len(buf)
                    rids.append(rid)
                    counts.append(n)
                    tokens.extend(buf)
                    buf.clear()
                    if req.params.logprobs is not None:
                        lps = lps if lps is not None else []
                        for lp in req.logprobs[len(req.out) - n:]:
                            if lp is not None:
                                lps.append((rid, lp.token, lp.logprob, list(lp.top)))
                if req.finished:
                    err = req.error
                    done.append(Finish(rid, req.finish_reason or "cancelled",
                                       None if err is None else _kind(err),
                                       None if err is None else _message(err)))
                    front.streams.pop(rid, None)
                    self._owner.pop(req.id, None)
            front.news = {}
            msg = Step(pack_i64(rids), pack_i32(counts), pack_i32(tokens), done, lps, stats,
                       phases)
            self._sock.send_multipart([front.ident, encode(msg)], copy=False)
        self._send_s += time.perf_counter() - t0

    def _engine_failed(self) -> None:
        """Tell every front, then exit so the supervisor starts a fresh core."""
        if self._failed:
            return
        self._failed = True
        why = str(self.engine.failure or "the engine failed")
        log.error("engine on %s failed (%s); exiting for a restart", self.device, why)
        for front in self._fronts.values():
            self._sock.send_multipart([front.ident, encode(Failed(why))])
        self.on_failed()


def _exit_soon() -> None:
    """Exit the process (status :data:`EXIT_FAILED`) once the failure messages went out."""
    asyncio.get_running_loop().call_later(0.2, os._exit, EXIT_FAILED)


def tune_await() -> None:
    """A core's awaits spin up to :data:`CORE_SPIN_US` before parking (module docstring),
    unless ``DEVICEOPS_AWAIT_SPIN_US`` is set."""
    if "DEVICEOPS_AWAIT_SPIN_US" not in os.environ:
        import deviceops

        deviceops.configure_await(spin_us=CORE_SPIN_US)


def _build(spec: CoreSpec) -> Any:
    from .cli import _build_engine

    return _build_engine(spec.model, device=spec.device, dtype=spec.dtype,
                         max_batch=spec.max_batch, max_seq=spec.max_seq,
                         max_queue=spec.max_queue, prefill_chunk=spec.prefill_chunk,
                         fail_stop=True, prefix_cache=spec.prefix_cache, weights=spec.weights)


def remove_ipc_endpoint(address: str) -> None:
    """Remove the socket file of an ``ipc://`` address and, when it is the last one there,
    its folder (``serve``'s per-run folder; ``rmdir`` leaves a folder that still holds a
    file). For a core whose ``serve`` died without cleaning up (kill -9): the last core to
    go leaves nothing in the temporary folder."""
    if not address.startswith("ipc://"):
        return
    path = address[len("ipc://"):]
    with contextlib.suppress(OSError):
        os.unlink(path)
    with contextlib.suppress(OSError):
        os.rmdir(os.path.dirname(path))


async def _watch_parent(core: EngineCore, parent: int) -> None:
    while True:
        await asyncio.sleep(PARENT_CHECK_S)
        if os.getppid() != parent:
            log.warning("the serve process went away; the engine core exits")
            remove_ipc_endpoint(core.address)
            os._exit(0)


async def _run(core: EngineCore, parent: int) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, core.stop)
    watch = asyncio.ensure_future(_watch_parent(core, parent))
    try:
        await core.serve()
    finally:
        watch.cancel()


def main(argv: Sequence[str] | None = None) -> int:
    """Load the engine of ``--spec``, bind ``--address``, serve until SIGTERM."""
    p = argparse.ArgumentParser(prog="python -m deviceops.nn.serving.core",
                                description="one device's engine core (started by serve)")
    p.add_argument("--address", required=True, help="ZeroMQ address to bind")
    p.add_argument("--spec", required=True, help="CoreSpec as JSON")
    p.add_argument("--reason-file", default=None,
                   help="where to write the one-line reason when the model cannot load")
    p.add_argument("--log-level", default="warning")
    args = p.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(name)s %(message)s")
    parent = os.getppid()
    spec = CoreSpec.from_json(args.spec)
    try:
        engine = _build(spec)
    except Exception as exc:
        reason = f"{type(exc).__name__}: {exc}".splitlines()[0]
        if args.reason_file:
            with open(args.reason_file, "w") as f:
                f.write(reason)
        print(f"engine core on {spec.device or 'the default device'}: cannot start: {reason}",
              file=sys.stderr)
        return EXIT_LOAD
    gc.collect()
    gc.freeze()  # a full cyclic GC would otherwise walk the start-up heap mid-step
    tune_await()
    core = EngineCore(engine, args.address, device=str(getattr(engine.model, "device", "")))
    from deviceops import _env

    folder = _env.get("DEVICEOPS_CORE_PROFILE")
    if not folder:
        asyncio.run(_run(core, parent))
        return 0
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    try:
        prof.runcall(asyncio.run, _run(core, parent))
    finally:
        out = io.StringIO()
        st = pstats.Stats(prof, stream=out)
        st.sort_stats("tottime").print_stats(40)
        st.sort_stats("cumulative").print_stats(40)
        with open(os.path.join(folder, f"core-{os.getpid()}.txt"), "w") as f:
            f.write(out.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())
