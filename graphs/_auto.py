"""Automatic graphs: a small DAG that repeats is captured once and replayed.

A job that many tenants run again and again (``await api.to_host(gemm(gemm(x, w1), w2))``)
is built afresh by the user each time, and each of its kernel ops pays its host cost (the
launch, the allocation of its output, the hazard step) every time: for small problems that
host time, not the GPU, is the job's cost. Under a policy with ``auto_graph`` (every
:class:`~deviceops.scheduling.Tenant` by default) the top-level execution of such a DAG
(:func:`deviceops._op._run`) asks :func:`run` first:

1. **Is it eligible?** The root reads a tensor back to the host (``api.to_host(op)``) and
   everything below it is kernel ops of the library's launchers (:class:`KernelSpec` ops
   that may be recorded: their device work goes through the driver and is a pure function
   of their plan and pointers, as for :mod:`deviceops.kernels.runtime._replay`), each
   used once, whose arguments are Tensors, ``None`` or those ops. Intermediate outputs
   are never seen by the caller: only the host copy is.
2. **Its key**: the stream, and per op its launcher (plan, or spec, statics and name) and
   its arguments (the leaf tensors' identities, the other ops' positions).
3. **A repeat?** The third sighting of a key captures a clone of the DAG into a
   :class:`~deviceops.graphs.CudaGraph` on the stream (its outputs allocated inside the
   capture and kept by the graph; the capture synchronizes the device once) and replays
   it; later sightings replay it: the user's ops are marked executed (they ran as the
   graph), the graph is launched (one driver call, ordered after other streams' use of
   the leaf tensors like any op) and the host copy is read from the graph's output.
   The first two sightings run eagerly, as without the policy.

Each entry keeps its leaf tensors and its intermediate outputs alive (device memory): at
most :data:`MAX_GRAPHS` entries, the least recently used dropped first. A DAG whose capture
fails is remembered and always runs eagerly. Same results as eager execution: the graph
runs the same kernels on the same plans (bit-equal outputs). A tenant created with
``auto_graph=False`` never does this; :func:`stats` counts captures, replays and fallbacks.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from deviceops import _hooks
from deviceops._api_op import _ApiOp
from deviceops._context import ExecutionContext, guard
from deviceops._op import _DONE, _FRESH, DeviceOp
from deviceops._tensor import Tensor

from ._graph import CudaGraph, capture_locked

__all__ = ["MAX_GRAPHS", "SIGHTINGS", "clear", "run", "stats"]

#: the sighting of a key that captures it (earlier ones run eagerly)
SIGHTINGS = 3
#: graphs kept at once (least recently used dropped first)
MAX_GRAPHS = 256
_MAX_KEYS = 4096  # keys counted (sightings) at once
_MAX_NODES = 64  # larger DAGs are not small jobs: never captured

_graphs: OrderedDict[tuple[Any, ...], _Entry | None] = OrderedDict()  # None: not capturable
_seen: OrderedDict[tuple[Any, ...], int] = OrderedDict()
_counts = {"captured": 0, "replayed": 0, "failed": 0}
# the kernel op classes and the override switch (imported at first use: deviceops imports
# this module before the kernel library exists)
_kinds: list[Any] = []


def _kernel_kinds() -> list[Any]:
    if not _kinds:
        from deviceops.kernels.runtime import _override
        from deviceops.kernels.runtime._spec import _DeferredOp, _PlannedOp

        _kinds.extend((_DeferredOp, _PlannedOp, _override))
    return _kinds


class _Entry:
    """A captured DAG: its graph, and the tensors its key names (kept alive with it)."""

    __slots__ = ("graph", "leaves")

    def __init__(self, graph: CudaGraph[Any], leaves: list[Tensor]) -> None:
        self.graph = graph
        self.leaves = leaves  # (the key holds their ids: alive as long as the entry)


def stats() -> dict[str, int]:
    """Captures made, replays run and captures that failed (then eager for that key)."""
    return {**_counts, "graphs": sum(1 for e in _graphs.values() if e is not None)}


def clear() -> None:
    """Drop every automatic graph and sighting (tests; frees their device memory)."""
    _graphs.clear()
    _seen.clear()
    for k in _counts:
        _counts[k] = 0


def _walk(op: DeviceOp[Any]) -> tuple[tuple[Any, ...], list[DeviceOp[Any]], list[Tensor]] | None:
    """``(key part, ops in post-order, leaf tensors)`` of the kernel DAG under ``op``, or
    ``None`` if it is not eligible."""
    deferred, planned, _ = _kernel_kinds()
    nodes: list[DeviceOp[Any]] = []
    leaves: list[Tensor] = []
    key: list[Any] = []
    index: dict[int, int] = {}

    def visit(n: DeviceOp[Any], depth: int) -> bool:
        if depth > _MAX_NODES:  # (a deep DAG: not small, and no deep recursion here)
            return False
        t = type(n)
        if t is deferred:
            spec = n._spec  # type: ignore[attr-defined]
            if not spec.replay or spec.out_pos < 0:
                return False
            head: Any = (spec, n._statics, n._name)  # type: ignore[attr-defined]
        elif t is planned:
            plan = n._plan  # type: ignore[attr-defined]
            if not plan.spec.replay:
                return False  # (a launcher whose work may not all go through the driver)
            head = plan
        else:
            return False
        if n._state == _DONE or id(n) in index:
            return False
        parts: list[Any] = [head]
        for a in n._args:  # type: ignore[attr-defined]
            if a is None:
                parts.append(None)
            elif type(a) is Tensor:
                leaves.append(a)
                parts.append(id(a))
            elif isinstance(a, DeviceOp):
                if not visit(a, depth + 1):
                    return False
                parts.append(-1 - index[id(a)])
            else:
                return False
        if len(nodes) >= _MAX_NODES:
            return False
        index[id(n)] = len(nodes)
        nodes.append(n)
        key.append(tuple(parts))
        return True

    if not visit(op, 1):
        return None
    return tuple(key), nodes, leaves


def _clone(nodes: list[DeviceOp[Any]]) -> list[DeviceOp[Any]]:
    """The same DAG as new ops, in the same order (the user's are left untouched for an
    eager fallback); the last is the root."""
    deferred, planned, _ = _kernel_kinds()
    made: dict[int, DeviceOp[Any]] = {}
    for n in nodes:
        args = tuple(made[id(a)] if isinstance(a, DeviceOp) else a for a in n._args)  # type: ignore[attr-defined]
        if type(n) is planned:
            c: DeviceOp[Any] = planned.make(n._plan, args)  # type: ignore[attr-defined]
        else:
            c = deferred(n._spec, n._name, n._statics, args)  # type: ignore[attr-defined]
        made[id(n)] = c
    return list(made.values())


def run(op: DeviceOp[Any], ctx: ExecutionContext) -> Any:
    """Run ``op`` as its automatic graph if it is a repeated eligible DAG; else
    :data:`deviceops._hooks.MISS` (the caller executes it)."""
    if type(op) is not _ApiOp or op._name != "to_host" or op._dep is None:
        return _hooks.MISS
    if _kernel_kinds()[2].installed or op._state != _FRESH:
        return _hooks.MISS
    stream = ctx.stream
    got = _walk(op._dep)
    if got is None:
        return _hooks.MISS
    part, nodes, leaves = got
    key = (stream.id, part)
    entry = _graphs.get(key)
    if entry is None:
        if key in _graphs:  # its capture failed: eager for good
            return _hooks.MISS
        n = _seen.get(key, 0) + 1
        if n < SIGHTINGS:
            _seen[key] = n
            _seen.move_to_end(key)
            if len(_seen) > _MAX_KEYS:
                _seen.popitem(last=False)
            return _hooks.MISS
        _seen.pop(key, None)
        clone = _clone(nodes)
        prev = guard.active  # (the top-level op: capture_locked leaves None)
        try:
            graph = capture_locked(clone[-1], stream, ctx.policy, allocates=True)
        except Exception:
            for c in clone:
                c._consume()  # (what the capture did not run: the failure is handled here)
            _counts["failed"] += 1
            _remember(key, None)
            return _hooks.MISS
        finally:
            guard.active = prev
        entry = _Entry(graph, leaves)
        _remember(key, entry)
        _counts["captured"] += 1
    else:
        _graphs.move_to_end(key)
    for node in nodes:  # they run as the graph
        node._state = _DONE
        node._ran_on = stream.id
    op._state = _DONE
    op._ran_on = stream.id
    entry.graph._replay(ctx)
    _counts["replayed"] += 1
    return op._fn(ctx, entry.graph._output)  # the host copy of the graph's output


def _remember(key: tuple[Any, ...], entry: _Entry | None) -> None:
    _graphs[key] = entry  # (a new key: the most recent)
    while len(_graphs) > MAX_GRAPHS:
        _graphs.popitem(last=False)


_hooks.install(auto_graph=run)
