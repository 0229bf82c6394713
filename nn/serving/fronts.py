"""Several HTTP front processes on one port (``serve --api-servers N``).

One front process does the HTTP, tokenising, detokenising and SSE of every stream; when it
is the limit (a core near one CPU at many clients), ``--api-servers N`` runs N of them. The
``serve`` process starts the engine cores (:mod:`.core_process`), then N - 1 more front
processes (``serve ... --attach-cores JSON``), and serves as the first front itself. Every
front binds the same host and port with ``SO_REUSEPORT``, so the kernel spreads new
connections over them, and connects its own clients to every core (a core serves any
number of fronts; :mod:`.protocol`).

Each front routes by the load it knows (its own requests), keeps its own ``/metrics``
(counters of the requests it served; the engine series are the cores' and the same in every
front) and answers ``/health`` for the cores it reaches. The ``serve`` process supervises
the cores: a restarted core is rejoined by every front. On SIGTERM ``serve`` passes the
signal to the other fronts, waits for them to drain, then stops the cores. A front whose
``serve`` process went away stops by itself.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

from .core_client import CoreClient, CoreModel, handshake
from .core_process import START_TIMEOUT_S, CoreReplica, CoreRouter

__all__ = ["FrontProcesses", "attach_cores", "reuse_port_socket", "watch_parent"]

log = logging.getLogger("deviceops.nn.serve")


def reuse_port_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` that other processes may bind too
    (``SO_REUSEPORT``: the kernel spreads connections over them).

    Raises:
        OSError: the platform has no ``SO_REUSEPORT`` (the message says so), or binding failed.
    """
    if not hasattr(socket, "SO_REUSEPORT"):
        raise OSError("--api-servers needs SO_REUSEPORT (Linux, macOS); run one front here")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(False)
    return sock


def attach_cores(cores: Sequence[tuple[str, str]], *, per_device: bool,
                 timeout_s: float = START_TIMEOUT_S) -> CoreRouter:
    """A router over clients of cores started by another process (an extra front).

    Args:
        cores: ``(device name, address)`` of each core.
        per_device: as the first front's router.

    Raises:
        RuntimeError: no core answered (each one's reason in the message).
    """
    replicas: list[CoreReplica] = []
    model: Any = None
    for name, address in cores:
        try:
            info = handshake(address, timeout_s=timeout_s)
        except RuntimeError as exc:
            replicas.append(CoreReplica(name, None, str(exc)))
            continue
        if model is None:
            model = CoreModel(info)
        replicas.append(CoreReplica(name, CoreClient(address, info, name=name, model=model)))
    if all(r.engine is None for r in replicas):
        raise RuntimeError("no engine core answered: " + "; ".join(
            f"{r.device}: {r.load_error}" for r in replicas))
    return CoreRouter(replicas, per_device=per_device)


def watch_parent(interval_s: float = 0.5) -> None:
    """Start a thread that sends this process SIGTERM (a graceful stop) once its parent is
    gone."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval_s)
        log.warning("the serve process went away; this front stops")
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, daemon=True, name="watch-parent").start()


def _without_api_servers(argv: Sequence[str]) -> list[str]:
    out: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
            continue
        if a == "--api-servers":
            skip = True
            continue
        if a.startswith("--api-servers="):
            continue
        out.append(a)
    return out


class FrontProcesses:
    """The extra front processes of ``serve --api-servers N`` (module docstring).

    Args:
        argv: ``serve``'s own arguments (``--api-servers`` is dropped from them).
        n: how many extra fronts to start.
    """

    def __init__(self, argv: Sequence[str], n: int) -> None:
        self.argv = _without_api_servers(argv)
        self.n = n
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, router: CoreRouter) -> None:
        """Start the fronts, each attached to ``router``'s cores."""
        cores = [(r.device, r.engine.address) for r in router.replicas
                 if isinstance(r, CoreReplica) and r.engine is not None]
        spec = json.dumps({"cores": cores, "per_device": router.per_device})
        for _ in range(self.n):
            self.procs.append(subprocess.Popen(
                [sys.executable, "-m", "deviceops.nn.serve", *self.argv, "--attach-cores", spec],
                stdin=subprocess.DEVNULL, start_new_session=True))  # signals come from serve

    def terminate(self) -> None:
        """SIGTERM to every front (they drain as ``serve`` does)."""
        for p in self.procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    p.send_signal(signal.SIGTERM)

    def wait(self, timeout_s: float) -> None:
        """Wait for every front to exit; kill what is left after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        for p in self.procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
