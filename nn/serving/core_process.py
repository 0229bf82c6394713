"""Engine cores as processes: starting and supervising them (:class:`CoreProcess`) and the
router over their clients (:class:`CoreRouter`, from :func:`start_cores`).

``python -m deviceops.nn.serve`` starts one engine core (:mod:`.core`) per device, each a
child process (``python -m deviceops.nn.serving.core``) bound to an ``ipc://`` socket in a
private temporary folder, all loading their models at once. The serving process keeps
the HTTP front: it tokenises, routes, detokenises and streams, and talks to each core
through a :class:`~.core_client.CoreClient`.

**Supervision.** A thread per core waits on its process. A core that exits while the
server runs (kill -9, a crash, a failed device step: status 1) is started again on the
same address after a short back-off (doubling, at most 5 s), and its client rejoins it by
itself when the new core answers (:mod:`.core_client`). A core whose model cannot load
(status 3) is not restarted: it is listed as failed, with the reason it wrote; nor is one
that was stopped on purpose (SIGTERM: status 0). More than
``max_restarts`` restarts within ``RESTART_WINDOW_S`` also leave it failed.

**Stopping.** :meth:`CoreRouter.close` (the app's shutdown, after the drain) sends SIGTERM to
every core, waits up to 10 s, then kills what is left and removes the socket folder. The
cores also exit by themselves when the serving process goes away (they watch their parent),
so none is left behind even after a kill -9 of ``serve``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .core import EXIT_LOAD, CoreSpec
from .core_client import CoreClient, CoreModel, handshake
from .router import Replica, Router

__all__ = ["CoreProcess", "CoreReplica", "CoreRouter", "start_cores"]

log = logging.getLogger("deviceops.nn.serve")

#: Seconds a core may take to load its model and answer before it is listed as failed.
START_TIMEOUT_S = 900.0
#: Restarts are counted over this many seconds (more than ``max_restarts``: failed).
RESTART_WINDOW_S = 60.0


class CoreProcess:
    """One engine core's process, started and restarted here (module docstring).

    Args:
        spec: what the core loads.
        address: the ZeroMQ address it binds.
        reason_file: where the core writes why it could not load.
        max_restarts: restarts allowed within :data:`RESTART_WINDOW_S`.
        log_level: the core's log level.
    """

    def __init__(self, spec: CoreSpec, address: str, *, reason_file: str,
                 max_restarts: int = 5, log_level: str = "warning") -> None:
        self.spec = spec
        self.address = address
        self.reason_file = reason_file
        self.max_restarts = max_restarts
        self.log_level = log_level
        self.proc: subprocess.Popen[bytes] | None = None
        self.restarts = 0
        self.dead: str | None = None  # why it will not be started again
        self.on_dead: Any = None  # called with the reason when it is given up
        self._stopping = False
        self._times: list[float] = []
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    @property
    def pid(self) -> int | None:
        """The running core's process id."""
        return None if self.proc is None else self.proc.pid

    def start(self) -> None:
        """Start the process (returns at once; the model loads in it)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.reason_file)
        cmd = [sys.executable, "-m", "deviceops.nn.serving.core", "--address", self.address,
               "--spec", self.spec.to_json(), "--reason-file", self.reason_file,
               "--log-level", self.log_level]
        # a session of its own: a terminal's Ctrl-C (or a signal to serve's process group)
        # reaches serve, which stops the cores after the fronts drained, not the cores first
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, start_new_session=True)
        if self._thread is None:
            self._thread = threading.Thread(target=self._supervise, daemon=True,
                                            name=f"core-{self.spec.device}")
            self._thread.start()

    def exit_reason(self) -> str | None:
        """``None`` while the process runs, else why it ended (its one-line reason)."""
        proc = self.proc
        if proc is None or proc.poll() is None:
            return None
        why = ""
        with contextlib.suppress(OSError), open(self.reason_file) as f:
            why = f.read().strip()
        return why or f"the engine core exited with status {proc.returncode}"

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> dict[str, Any]:
        """Block until the core answers (its :class:`~.protocol.Ready` info).

        Raises:
            RuntimeError: it exited first (the message is its reason) or did not answer.
        """
        return handshake(self.address, timeout_s=timeout_s, alive=self.exit_reason)

    def _supervise(self) -> None:
        delay = 0.2
        while True:
            proc = self.proc
            if proc is None:
                return
            rc = proc.wait()
            with self._lock:
                if self._stopping:
                    return
                if rc == EXIT_LOAD:
                    self._give_up(self.exit_reason() or "the model could not load")
                    return
                if rc == 0:  # stopped on purpose (SIGTERM to the core): not restarted
                    self._give_up("the engine core was stopped (it exited with status 0)")
                    return
                now = time.monotonic()
                self._times = [t for t in self._times if now - t < RESTART_WINDOW_S] + [now]
                if len(self._times) > self.max_restarts:
                    self._give_up(f"exited {len(self._times)} times within "
                                  f"{RESTART_WINDOW_S:g} s (last status {rc})")
                    return
                log.error("engine core on %s exited with status %s; restarting it",
                          self.spec.device or "the default device", rc)
            time.sleep(delay)
            delay = min(2 * delay, 5.0)
            with self._lock:
                if self._stopping:
                    return
                self.restarts += 1
                self.start()

    def _give_up(self, why: str) -> None:
        self.dead = why
        log.error("engine core on %s will not be restarted: %s",
                  self.spec.device or "the default device", why)
        if self.on_dead is not None:
            self.on_dead(why)

    def terminate(self) -> None:
        """SIGTERM now, no restart, without waiting."""
        with self._lock:
            self._stopping = True
            proc = self.proc
        if proc is not None and proc.poll() is None:
            proc.terminate()

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM, wait up to ``timeout_s``, then SIGKILL."""
        self.terminate()
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def kill(self) -> None:
        """SIGKILL now (no restart)."""
        with self._lock:
            self._stopping = True
            proc = self.proc
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()


@dataclass(eq=False)
class CoreReplica(Replica):
    """One device's engine core as the router sees it; ``engine`` is its
    :class:`~.core_client.CoreClient` once the core answered, ``process`` its
    :class:`CoreProcess`."""

    engine: Any = None
    process: CoreProcess | None = None
    #: what :attr:`error` says of a client whose core will not come back
    dead_why = "the engine core will not be restarted"

    @property
    def state(self) -> str:
        """``serving``, ``restarting`` (the core died and is being started again),
        ``draining``, ``closed`` or ``failed``."""
        eng = self.engine
        if eng is None or eng.dead is not None:
            return "failed"
        if eng.failure is not None:
            return "restarting"
        if eng.draining:
            return "draining"
        return "closed" if eng.closed else "serving"

    @property
    def error(self) -> str | None:
        """Why it does not serve, else ``None``."""
        if self.load_error is not None:
            return f"loading the model failed: {self.load_error}"
        eng = self.engine
        if eng is None:
            return None
        if eng.dead is not None:
            return f"{self.dead_why}: {eng.dead}"
        return None if eng.failure is None else str(eng.failure)

    def describe(self) -> dict[str, Any]:
        """The ``/health`` entry: device, state, load, requests, pid, restarts, error."""
        out = super().describe()
        eng = self.engine
        out["pid"] = self.process.pid if self.process is not None else (
            None if eng is None else eng.info.get("pid"))
        out["restarts"] = 0 if eng is None else eng.restarts
        return out


class CoreRouter(Router):
    """Least-loaded routing over engine-core clients; owns the core processes.

    Args:
        replicas: one :class:`CoreReplica` per device.
        per_device: as :class:`~.router.Router` (``False``: one core served as a plain
            engine, no device labels).
        folder: the socket folder to remove on :meth:`close`.
    """

    def __init__(self, replicas: Sequence[CoreReplica], *, per_device: bool,
                 folder: str | None = None) -> None:
        super().__init__(replicas, per_device=per_device)
        self.folder = folder
        #: called first by :meth:`close`, before the cores stop (``serve --api-servers``
        #: waits there for its other fronts to drain)
        self.before_stop: list[Any] = []

    def _cores(self) -> list[CoreReplica]:
        return [r for r in self.replicas if isinstance(r, CoreReplica)]

    def attach(self) -> None:
        """Connect every client from the running loop (the app does once ready)."""
        for r in self._cores():
            if r.engine is not None:
                r.engine.attach()

    def close(self) -> None:
        """Close every client, stop every core process, remove the sockets' folder."""
        for fn in self.before_stop:
            fn()
        super().close()
        procs = [r.process for r in self._cores() if r.process is not None]
        for p in procs:  # SIGTERM to all first: they stop in parallel
            p.terminate()
        for p in procs:
            p.stop()
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)


def start_cores(spec: CoreSpec, devices: Sequence[str | None], *,
                per_device: bool | None = None, max_restarts: int = 5,
                log_level: str = "warning",
                timeout_s: float = START_TIMEOUT_S) -> CoreRouter:
    """Start one engine core per device (all loading at once), wait until they answer, and
    return the router over their clients.

    Args:
        spec: what each core loads (its ``device`` is replaced by each of ``devices``).
        devices: device names (``"cuda:0"``, ``"cpu:1"``; ``None``: the default device).
        per_device: ``/health`` and ``/metrics`` per device (default: more than one device).
        max_restarts, log_level: each :class:`CoreProcess`'s.
        timeout_s: how long a core may take to load.

    Raises:
        RuntimeError: no core started; the message has each one's reason.
    """
    import dataclasses

    folder = tempfile.mkdtemp(prefix="deviceops-cores-")
    procs: list[CoreProcess] = []
    try:
        for i, dev in enumerate(devices):
            p = CoreProcess(dataclasses.replace(spec, device=dev),
                            f"ipc://{folder}/core{i}.sock",
                            reason_file=os.path.join(folder, f"core{i}.reason"),
                            max_restarts=max_restarts, log_level=log_level)
            p.start()
            procs.append(p)
        replicas: list[CoreReplica] = []
        model: Any = None
        for dev, p in zip(devices, procs, strict=True):
            name = dev or "default"
            try:
                info = p.wait_ready(timeout_s)
            except RuntimeError as exc:
                log.error("the engine core on %s did not start: %s", name, exc)
                p.kill()
                replicas.append(CoreReplica(name, None, str(exc), process=p))
                continue
            if model is None:
                model = CoreModel(info)
            client = CoreClient(p.address, info, name=str(info.get("device") or name),
                                model=model)
            p.on_dead = _dead_setter(client)
            replicas.append(CoreReplica(client.name, client, process=p))
    except BaseException:
        for p in procs:
            p.kill()
        shutil.rmtree(folder, ignore_errors=True)
        raise
    if all(r.engine is None for r in replicas):
        shutil.rmtree(folder, ignore_errors=True)
        raise RuntimeError("no engine core started: " + "; ".join(
            f"{r.device}: {r.load_error}" for r in replicas))
    if per_device is None:
        per_device = len(replicas) > 1
    return CoreRouter(replicas, per_device=per_device, folder=folder)


def _dead_setter(client: CoreClient) -> Any:
    def dead(why: str) -> None:
        client.dead = why

    return dead
