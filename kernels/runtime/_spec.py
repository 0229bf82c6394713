"""Kernel specs: a launcher described once, its plans computed once per signature.

A launcher (``rms_norm``, ``gemm``, ``flash_attention``, ...) is a module-level
:class:`KernelSpec`: its name, its argument names, and ``parts(*statics) -> (check, body)``,
a factory of the two functions of :mod:`._builder` (``check(ts)`` validates and says what the
outputs are, ``body(ctx, ts)`` launches). The statics are the launcher's scalar parameters
(``eps``, ``activation``, ``trans_b``, ...): every value the check or the body may depend on
besides the tensors, so the key below is complete by construction. A call::

    return _RMS_NORM.op((x, weight, out), (eps,))

builds the op in a few hundred nanoseconds when every argument is a Tensor (or an allowed
``None``):

| step            | per call                         | once per key                         |
|-----------------|----------------------------------|--------------------------------------|
| construction    | the key: device, statics, each tensor's interned signature and storage id | the full check (:class:`Plan`), in :mod:`._plan` |
| execution, cuda | device check, allocation of missing outputs, pointer key, :meth:`._replay.Record.run` | the body, recorded (:mod:`._replay`) |
| execution, cpu  | device check, allocation, the body (the NumPy reference on the stream's worker) | |

The plan key (``(device, spec, statics, signature)``, :mod:`._plan`) holds the storages'
``id`` s only (the alias pattern); nothing of the caller's is kept alive by a plan or a
record. A plan's replay records are part of its entry (:attr:`Plan.replays`). Partition and DeviceOp arguments take
:mod:`._builder`'s general path (checked once their values are known).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from deviceops.extend import (
    DONE,
    FRESH,
    DeviceOp,
    ExecutionContext,
    Tensor,
    allocate,
    check_device,
    trace_state,
)
from deviceops.extend import drive as _drive

from . import _override, _plan, _replay
from ._builder import OPTIONAL_ARGS, Body, _general_op, _outputs, plain_args
from ._op import KernelOp
from ._plan import _cache as _plans
from ._plan import _counts as _plan_counts
from ._replay import Record, record, recording

__all__ = ["KernelSpec", "Plan"]

Parts = Callable[..., tuple[Callable[[Any], Any], Body]]
_REPLAYS_PER_PLAN = 64
# pointer keys seen once (not recorded yet) per plan: once a plan holds _REPLAYS_PER_PLAN
# records, a new key is recorded only at its second execution, so a stream of ever-new
# pointers (DeviceOp arguments' fresh outputs under many tenants) runs the plain body instead
# of paying for recordings that are evicted before they are replayed
_SEEN_PER_PLAN = 256
_PARTS_LIMIT = 256


class KernelSpec:
    """One kernel launcher: name, argument names, and the ``(check, body)`` factory.

    Args:
        name: the kernel's name (errors, traces).
        keys: the argument names, in the order :meth:`op` receives the values.
        parts: ``parts(*statics) -> (check, body)``; ``check`` returns the ``(shape,
            dtype)`` of ``out``, or with ``outputs`` :data:`._builder.Outputs`.
        returns: the argument the op produces (``"out"``), or ``returns(values) -> output``
            (the values as given, allocated outputs filled in).
        outputs: ``check`` returns :data:`._builder.Outputs` (``{name: (shape, dtype)}``).
        defaults: an output left ``None`` that aliases another argument
            (``{"residual_out": "residual"}``).
        optional: arguments that may be ``None`` besides ``out`` and ``*_out``.
        replay: the body submits device work only through :mod:`._driver`, so its
            driver calls may be recorded and replayed (:mod:`._replay`).
    """

    __slots__ = ("_parts", "defaults", "keys", "name", "optional", "out_pos", "outputs", "parts",
                 "replay", "result")

    def __init__(self, name: str, keys: tuple[str, ...], parts: Parts, *,
                 returns: str | Callable[[dict[str, Any]], Any] = "out", outputs: bool = False,
                 defaults: Mapping[str, str] | None = None,
                 optional: tuple[str, ...] = OPTIONAL_ARGS, replay: bool = False) -> None:
        self.name = name
        self.keys = keys
        self.parts = parts
        self.outputs = outputs
        self.defaults = dict(defaults or {})
        self.optional = optional
        self.replay = replay
        if isinstance(returns, str):
            self.out_pos = keys.index(returns)
            pos = self.out_pos
            self.result: Callable[[dict[str, Any]], Any] = lambda v: v[keys[pos]]
        else:
            self.out_pos = -1
            self.result = returns
        self._parts: dict[tuple[Any, ...], tuple[Callable[[Any], Any], Body]] = {}

    def __repr__(self) -> str:
        return f"KernelSpec({self.name!r})"

    def op(self, vals: tuple[Any, ...], statics: tuple[Any, ...] = (), name: str | None = None
           ) -> KernelOp:
        """The KernelOp for ``vals`` (in :attr:`keys` order) and the launcher's ``statics``.

        ``name`` (default: the spec's) names the op in errors and traces when one spec
        serves several launchers (``gemm``/``matmul``); it must be among the statics.

        Raises:
            TypeError: a required argument is ``None`` or not a Tensor/Partition/DeviceOp.
            ShapeError, DTypeError, DeviceError: tensor arguments that do not fit.
        """
        sig: list[Any] = []
        app = sig.append
        dev = None
        for v in vals:
            if type(v) is Tensor:
                sid = v._sig_id
                if sid < 0:
                    sid = v.signature_id()
                    if sid < 0:  # the signature table is full: check every time
                        return _PlannedOp.make(self._new_plan(vals, statics, name), vals)
                st = v._storage
                if dev is None:
                    dev = st.device
                app(sid)
                app(id(st))
            elif v is None:
                app(None)
            else:
                return self._general(vals, statics, name)
        k = (dev, self, statics, tuple(sig))  # (device, op, statics, signature): ._plan
        try:
            plan = _plans.get(k)
        except TypeError:  # an unhashable static: no caching
            return _PlannedOp.make(self._new_plan(vals, statics, name), vals)
        if plan is None:
            _plan_counts[1] += 1
            plan = _plan.store(k, self._new_plan(vals, statics, name))
        else:
            _plan_counts[0] += 1
        op = _new_op(_PlannedOp)
        op._state = FRESH
        op._ran_on = 0
        op._name = plan.name
        op._args = vals
        op._plan = plan
        return op

    def parts_for(self, statics: tuple[Any, ...]) -> tuple[Callable[[Any], Any], Body]:
        """``parts(*statics)``, made once per statics tuple (bounded)."""
        try:
            got = self._parts.get(statics)
        except TypeError:
            return self.parts(*statics)
        if got is None:
            got = self.parts(*statics)
            if len(self._parts) >= _PARTS_LIMIT:
                del self._parts[next(iter(self._parts))]
            self._parts[statics] = got
        return got

    def _new_plan(self, vals: tuple[Any, ...], statics: tuple[Any, ...], name: str | None) -> Plan:
        """The full check of tensor arguments ``vals`` (raises what the check raises)."""
        name = name or self.name
        args = dict(zip(self.keys, vals, strict=True))
        plain_args(name, args, self.optional)  # a required None raises TypeError
        check, body = self.parts_for(statics)
        ts = dict(args)
        for k, src in self.defaults.items():
            if ts[k] is None:
                ts[k] = ts[src]
        outs = _outputs(name, ts, check, not self.outputs)
        return Plan(self, name, body, ts, outs)

    def _general(self, vals: tuple[Any, ...], statics: tuple[Any, ...], name: str | None
                 ) -> KernelOp:
        """Partition or DeviceOp arguments: a :class:`_DeferredOp` when every argument is a
        Tensor, ``None`` or a DeviceOp (planned once the values are known), else
        :mod:`._builder`'s general path."""
        name = name or self.name
        args = dict(zip(self.keys, vals, strict=True))
        if plain_args(name, args, self.optional):  # (raises for a bad argument)
            return _PlannedOp.make(self._new_plan(vals, statics, name), vals)
        for v in vals:
            if v is not None and type(v) is not Tensor and not isinstance(v, DeviceOp):
                check, body = self.parts_for(statics)
                return _general_op(name, args, check, not self.outputs, body, self.result,
                                   self.defaults)
        return _DeferredOp(self, name, statics, vals)

    def run_values(self, ctx: ExecutionContext, vals: tuple[Any, ...], statics: tuple[Any, ...],
                   name: str) -> Any:
        """Check (through the plan cache), allocate and launch for argument values known
        only now (a :class:`_DeferredOp`'s, once its DeviceOp arguments have run).

        Tensor values take the planned path: the plan keyed by the signatures and the
        alias pattern *as positions* (a DeviceOp's output is a fresh storage each time, so
        its ``id`` would make every call a miss), then :meth:`Plan.execute`, replayed when
        recorded. A DeviceOp that produced a Partition (or anything else) takes
        :mod:`._builder`'s general path for this call.
        """
        sig: list[Any] = []
        app = sig.append
        dev = None
        seen: dict[int, int] = {}
        for v in vals:
            if v is None:
                app(None)
                continue
            if type(v) is not Tensor:
                check, body = self.parts_for(statics)
                op = _general_op(name, dict(zip(self.keys, vals, strict=True)), check,
                                 not self.outputs, body, self.result, self.defaults)
                op._consume()  # (only its run function is used, for this call)
                return op._run(ctx, *vals)
            sid = v._sig_id
            if sid < 0:
                sid = v.signature_id()
                if sid < 0:  # the signature table is full: check every time
                    return self._new_plan(vals, statics, name).execute(ctx, vals)
            st = v._storage
            if dev is None:
                dev = st.device
            app(sid)
            app(seen.setdefault(id(st), len(seen)))
        k = (dev, self, statics, tuple(sig), "positions")  # (see .op's key; aliases as positions)
        try:
            plan = _plans.get(k)
        except TypeError:  # an unhashable static: no caching
            return self._new_plan(vals, statics, name).execute(ctx, vals)
        if plan is None:
            _plan_counts[1] += 1
            plan = _plan.store(k, self._new_plan(vals, statics, name))
        else:
            _plan_counts[0] += 1
        return plan.execute(ctx, vals)


class Plan:
    """What one (spec, statics, signatures, alias pattern) decided, and its replays."""

    __slots__ = ("body", "defaults", "device", "first", "missing", "name", "replays", "seen", "spec")

    def __init__(self, spec: KernelSpec, name: str, body: Body, ts: Mapping[str, Tensor | None],
                 outs: Mapping[str, tuple[tuple[int, ...], Any]]) -> None:
        keys = spec.keys
        self.spec = spec
        self.name = name
        self.body = body
        self.first = next(i for i, k in enumerate(keys) if ts[k] is not None)
        first = ts[keys[self.first]]
        assert first is not None
        self.device = first._storage.device
        self.defaults = tuple((keys.index(k), keys.index(src)) for k, src in spec.defaults.items())
        self.missing = tuple((keys.index(k), shape, dt) for k, (shape, dt) in outs.items()
                             if ts[k] is None)
        self.replays: dict[tuple[int, ...], Record] | None = (
            {} if spec.replay and not self.device.is_cpu else None)
        self.seen: dict[tuple[int, ...], None] = {}  # pointer keys run once, not recorded

    def execute(self, ctx: ExecutionContext, args: tuple[Any, ...]) -> Any:
        """Allocate missing outputs, launch (replayed when recorded), return the output."""
        spec = self.spec
        stream = ctx.stream
        if stream.device is not self.device:
            check_device(args[self.first], stream, self.name)
        if self.defaults or self.missing:
            args = self._complete(stream, args)
        reps = self.replays
        if (reps is not None and stream.capture is None and trace_state.current is None
                and _replay.enabled and not _override.installed):
            native = stream.native.ptr
            pk = [stream.id]
            for a in args:
                pk.append(0 if a is None else a._array.data.ptr)
            key = tuple(pk)
            rec = reps.get(key)
            if rec is None and len(reps) >= _REPLAYS_PER_PLAN and key not in self.seen:
                # a full plan's first sighting of this key: run, remember
                seen = self.seen
                if len(seen) >= _SEEN_PER_PLAN:
                    del seen[next(iter(seen))]
                seen[key] = None
                self.body(ctx, self._tensors(args))
            elif rec is None or not rec.run(stream, args, native):
                self.seen.pop(key, None)
                with recording() as (calls, sets):
                    self.body(ctx, self._tensors(args))
                rec = record(calls, sets, args)
                if rec is not None:
                    if len(reps) >= _REPLAYS_PER_PLAN:
                        del reps[next(iter(reps))]
                    reps[key] = rec
        else:
            self.body(ctx, self._tensors(args))
        if spec.out_pos >= 0:
            return args[spec.out_pos]
        return spec.result(dict(zip(spec.keys, args, strict=True)))

    def _complete(self, stream: Any, args: tuple[Any, ...]) -> tuple[Any, ...]:
        vals = list(args)
        for i, src in self.defaults:
            if vals[i] is None:
                vals[i] = vals[src]
        for i, shape, dt in self.missing:
            vals[i] = allocate(stream, shape, dt, self.name)
        return tuple(vals)

    def _tensors(self, args: tuple[Any, ...]) -> dict[str, Tensor]:
        return {k: a for k, a in zip(self.spec.keys, args, strict=True) if a is not None}


class _PlannedOp(KernelOp):
    """A KernelOp whose arguments are Tensors (or ``None``) with a plan already made."""

    __slots__ = ("_plan",)
    _plan: Plan

    @classmethod
    def make(cls, plan: Plan, vals: tuple[Any, ...]) -> _PlannedOp:
        """The op (as :meth:`KernelSpec.op` builds it inline on its per-call path)."""
        op = _new_op(cls)
        op._state = FRESH
        op._ran_on = 0
        op._name = plan.name
        op._args = vals
        op._plan = plan
        return op

    def _exec(self, ctx: ExecutionContext) -> Any:
        # DeviceOp._exec with _execute folded in (one call less on every planned op's path)
        if self._state == DONE:
            return DeviceOp._exec(self, ctx)  # raises: a DeviceOp runs once
        self._state = DONE
        self._ran_on = ctx.stream.id
        return self._plan.execute(ctx, self._args)

    def _execute(self, ctx: ExecutionContext) -> Any:
        return self._plan.execute(ctx, self._args)

    def _finish(self, ctx: ExecutionContext, vals: list[Any]) -> Any:
        return self._plan.execute(ctx, self._args)

    def _deps(self, ctx: ExecutionContext) -> tuple[DeviceOp[Any], ...]:
        return ()  # (its arguments are Tensors or None: nothing to execute first)

    def _compile_key(self) -> Any:
        return self._plan  # one per (launcher, statics, signatures): what it may compile


def _unplanned(ctx: ExecutionContext, *vals: Any) -> Any:  # (a _DeferredOp finishes instead)
    raise AssertionError("a _DeferredOp runs through _finish")


class _DeferredOp(KernelOp):
    """A KernelSpec op with DeviceOp arguments (and Tensors or ``None``): the DeviceOps run
    first on the same stream, then :meth:`KernelSpec.run_values` checks the values through
    the plan cache and launches (replayed when recorded), as for Tensor arguments."""

    __slots__ = ("_spec", "_statics")

    def __init__(self, spec: KernelSpec, name: str, statics: tuple[Any, ...], vals: tuple[Any, ...]
                 ) -> None:
        KernelOp.__init__(self, name, _unplanned, vals)
        self._spec = spec
        self._statics = statics

    def _execute(self, ctx: ExecutionContext) -> Any:
        return _drive(self, ctx)

    def _finish(self, ctx: ExecutionContext, vals: list[Any]) -> Any:
        args = list(self._args)
        for i, v in zip(self._dpos, vals, strict=True):
            args[i] = v
        return self._spec.run_values(ctx, tuple(args), self._statics, self._name)


_new_op = object.__new__
