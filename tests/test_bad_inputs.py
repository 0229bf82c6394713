"""Issue 16, item 4: a table-driven battery of bad inputs.

Every case calls one public function (``deviceops.api``, ``deviceops.kernels``, ``Tensor``,
``Partition``, ``deviceops.device``, the combinators) with one bad argument and expects a
``TypeError`` / ``ValueError`` (``DTypeError`` / ``ShapeError`` are subclasses) raised at
once -- at construction, before anything is enqueued -- whose message matches a fragment
naming the op and the argument. Runs on the default device (cpu in CI, cuda on a GPU).

Adding a kernel: append a :class:`KernelSpec` to ``KERNELS`` (its valid arguments, which
arguments are tensors, which are optional, its scalar arguments' bad values). The generic
mutations (wrong types, ``None`` for a required tensor, wrong dtype, non-contiguous input,
a wrong ``out``) are generated from it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

import deviceops
from deviceops import DeviceOp, DTypeError, Partition, SchedulingError, ShapeError, Tensor, api
from deviceops import kernels as K

# -- shared inputs (made once per device, lazily) ------------------------------------------------

_cache: dict[str, Any] = {}


def T(shape: tuple[int, ...], dtype: str = "float32", fill: float = 0.5) -> Tensor:
    """A tensor of the default device (cached by shape, dtype and fill)."""
    if dtype.startswith("int") and fill != int(fill):
        fill = 1
    key = f"{shape}{dtype}{fill}"
    t = _cache.get(key)
    if t is None:
        s = _cache.get("stream")
        if s is None:
            s = _cache["stream"] = deviceops.default_device().new_stream()
        t = _cache[key] = api.full(shape, fill, dtype).sync_on(s)
    return t


def noncontig(shape: tuple[int, int], dtype: str = "float32") -> Tensor:
    """A transposed (non-C-contiguous) view: shape ``shape``."""
    base = T((shape[1], shape[0]), dtype)
    return Tensor(base.array.T)


@dataclass
class Case:
    id: str
    call: Callable[[], Any]
    exc: type[BaseException] | tuple[type[BaseException], ...]
    match: str


CASES: list[Case] = []


def case(id: str, call: Callable[[], Any], exc: Any, match: str) -> None:
    CASES.append(Case(id, call, exc, match))


# -- api: shapes -------------------------------------------------------------------------------

BAD_SHAPES: list[Any] = ["12", (2.5, 3), True, None, -1, (2, -3), 2.5, (None,), [1, "a"],
                         {"a": 1}, (1, (2,)), (np.float32(2),), b"12", (False, 2)]
SHAPED = {
    "zeros": lambda s: api.zeros(s),
    "ones": lambda s: api.ones(s),
    "empty": lambda s: api.empty(s),
    "full": lambda s: api.full(s, 1.0),
    "rand": lambda s: api.rand(s),
    "randn": lambda s: api.randn(s),
}
for fname, f in SHAPED.items():
    for i, bad in enumerate(BAD_SHAPES):
        case(f"api.{fname}-shape{i}-{bad!r}", lambda f=f, bad=bad: f(bad), ShapeError,
             rf"{fname}: shape")

# -- api: dtypes -------------------------------------------------------------------------------

BAD_DTYPES: list[Any] = ["float64", "bool", "complex64", np.float64, "int8", "uint8", "int16",
                         None, 5, "nonsense", np.complex128, object]
DTYPED = {
    "zeros": lambda d: api.zeros((2,), d),
    "ones": lambda d: api.ones((2,), d),
    "empty": lambda d: api.empty((2,), d),
    "full": lambda d: api.full((2,), 1, d),
    "arange": lambda d: api.arange(3, dtype=d),
    "linspace": lambda d: api.linspace(0, 1, 3, d),
    "eye": lambda d: api.eye(3, dtype=d),
    "rand": lambda d: api.rand((2,), d),
    "randn": lambda d: api.randn((2,), d),
    "convert": lambda d: api.convert(T((2,)), d),
    "from_host": lambda d: api.from_host(np.zeros(2, np.float32), d),
}
for fname, f in DTYPED.items():
    for i, bad in enumerate(BAD_DTYPES):
        if bad is None and fname in ("arange", "from_host"):
            continue  # None: inferred from the values
        case(f"api.{fname}-dtype{i}-{bad!r}", lambda f=f, bad=bad: f(bad), DTypeError,
             rf"{fname}: .*(not supported|not a dtype).*")
for fname in ("rand", "randn"):
    for d in ("int32", "int64"):
        case(f"api.{fname}-intdtype-{d}", lambda fname=fname, d=d: getattr(api, fname)((2,), d),
             DTypeError, rf"{fname}: needs a floating dtype")

# -- api: scalars ------------------------------------------------------------------------------

for d, vals in {
    "int32": [math.nan, math.inf, -math.inf, 1.5, 2**31, -(2**31) - 1, 1e300, -0.5],
    "int64": [math.nan, math.inf, 2.5, 2**63, -(2**63) - 1, 1e30],
    "float16": [1e6, -7e4],
    "bfloat16": [1e39],
    "float32": [1e39, -1e300],
}.items():
    for v in vals:
        case(f"api.full-fill-{d}-{v!r}", lambda d=d, v=v: api.full((3,), v, d), ValueError,
             rf"full: fill_value .*{d}")
for v in [None, "1", True, [1], (1,), b"1", 1j, object()]:
    for d in ("float32", "int32"):
        case(f"api.full-fill-type-{d}-{v!r}", lambda d=d, v=v: api.full((3,), v, d), TypeError,
             r"full: fill_value must be a real number")
for arg, call in {
    "start": lambda v: api.arange(v, 5),
    "stop": lambda v: api.arange(0, v),
    "step": lambda v: api.arange(0, 5, v),
    "stop-only": lambda v: api.arange(v),
}.items():
    for v in [math.nan, math.inf, -math.inf]:
        case(f"api.arange-{arg}-{v!r}", lambda call=call, v=v: call(v), ValueError,
             r"arange: (start|stop|step) must be finite")
    for v in [None, "a", True, [1], 1j]:
        if v is None and arg == "stop":
            continue  # arange(start, None): the one-argument form
        case(f"api.arange-{arg}-type-{v!r}", lambda call=call, v=v: call(v), TypeError,
             r"arange: (start|stop|step) must be a real number")
case("api.arange-step0", lambda: api.arange(0, 5, 0), ShapeError, "arange: step must not be zero")
case("api.arange-int-overflow", lambda: api.arange(0, 2**40, 2**35, dtype="int32"), ValueError,
     r"arange: last value .*int32")
for arg, call in {"start": lambda v: api.linspace(v, 1, 5), "stop": lambda v: api.linspace(0, v, 5)}.items():
    for v in [math.nan, math.inf]:
        case(f"api.linspace-{arg}-{v!r}", lambda call=call, v=v: call(v), ValueError,
             rf"linspace: {arg} must be finite")
    for v in ["a", None, True, [0]]:
        case(f"api.linspace-{arg}-type-{v!r}", lambda call=call, v=v: call(v), TypeError,
             rf"linspace: {arg} must be a real number")
for v in [None, 2.5, "5", True, [5]]:
    case(f"api.linspace-num-{v!r}", lambda v=v: api.linspace(0, 1, v), TypeError,
         r"linspace: num must be an int")
case("api.linspace-num-negative", lambda: api.linspace(0, 1, -1), ShapeError, r"linspace: num must be >= 0")
for v in ["yes", None, 1]:
    case(f"api.linspace-endpoint-{v!r}", lambda v=v: api.linspace(0, 1, 5, endpoint=v), TypeError,
         r"linspace: endpoint must be a bool")
for arg, call in {"n": lambda v: api.eye(v), "m": lambda v: api.eye(3, v)}.items():
    for v in [None, 2.5, "3", True, [3]]:
        if v is None and arg == "m":
            continue  # eye(n, None): square
        case(f"api.eye-{arg}-{v!r}", lambda call=call, v=v: call(v), TypeError,
             rf"eye: {arg} must be an int")
    case(f"api.eye-{arg}-negative", lambda call=call: call(-1), ShapeError, rf"eye: {arg} must be >= 0")
for v in [1.5, None, "1", True, [1]]:
    case(f"api.eye-k-{v!r}", lambda v=v: api.eye(3, k=v), TypeError, r"eye: k \(the diagonal\) must be an int")
for fname in ("rand", "randn"):
    for v in [-1, 1.5, "1", True, [1], -(2**70)]:
        case(f"api.{fname}-seed-{v!r}", lambda fname=fname, v=v: getattr(api, fname)((3,), seed=v),
             ValueError, rf"{fname}: seed must be None or an int >= 0")

# -- api: tensor arguments ---------------------------------------------------------------------

NOT_TENSORS: list[Any] = [None, 5, "x", [1.0, 2.0], np.ones(2, np.float32), 1.5]
TENSOR_FNS: dict[str, Callable[[Any], Any]] = {
    "dup": lambda v: api.dup(v),
    "convert": lambda v: api.convert(v, "float16"),
    "to_host": lambda v: api.to_host(v),
    "to_device": lambda v: api.to_device(v, "cpu"),
    "memcpy-dst": lambda v: api.memcpy(v, T((2,))),
    "memcpy-src": lambda v: api.memcpy(T((2,)), v),
}
for fname, f in TENSOR_FNS.items():
    for i, bad in enumerate(NOT_TENSORS):
        op = fname.split("-")[0]
        arg = {"memcpy-dst": "dst", "memcpy-src": "src"}.get(fname, "t")
        case(f"api.{fname}-arg{i}-{type(bad).__name__}", lambda f=f, bad=bad: f(bad), TypeError,
             rf"{op}: argument '{arg}' must be a Tensor")
for i, bad in enumerate([1.5, None, "gpu", "cuda:x", -1, True, [], "cuda:-1", "cpu0", 2.0]):
    exc = TypeError if not isinstance(bad, str | int) or isinstance(bad, bool) else ValueError
    case(f"api.to_device-device{i}-{bad!r}", lambda bad=bad: api.to_device(T((2,)), bad),
         (TypeError, ValueError), r"(to_device|device): .*(device|ordinal)")
case("api.memcpy-shape", lambda: api.memcpy(T((2,)), T((3,))), ShapeError,
     r"memcpy: dst shape \(2,\) != src shape \(3,\)")
case("api.memcpy-dtype", lambda: api.memcpy(T((2,)), T((2,), "float16")), DTypeError,
     r"memcpy: dst dtype float32 != src dtype float16; use api.convert")
for i, bad in enumerate([None, "abc", [1, [2, 3]], object(), {"a": 1}, [True, False],
                         np.array(["a"]), np.zeros(2, complex)]):
    case(f"api.from_host-{i}-{type(bad).__name__}", lambda bad=bad: api.from_host(bad),
         (TypeError, DTypeError), r"from_host: ")
case("api.from_host-float64-no-dtype", lambda: api.from_host(np.zeros(2)), DTypeError,
     r"from_host: dtype float64 is not supported; use one of float32")
case("api.from_host-tensor", lambda: api.from_host(T((2,))), TypeError, r"from_host: .*api.dup")

# -- device ------------------------------------------------------------------------------------

for i, bad in enumerate([None, 1.5, "gpu", "cuda:x", -1, True, [], "cuda:-1", "CPU", "cuda:0:1",
                         b"cpu", 0.0]):
    case(f"device-{i}-{bad!r}", lambda bad=bad: deviceops.device(bad), (TypeError, ValueError),
         r"device: ")
for i, bad in enumerate([None, 1.5, "gpu", True]):
    case(f"set_default_device-{i}-{bad!r}",
         lambda bad=bad: deviceops.set_default_device(bad) if bad is not None else
         deviceops.device(bad), (TypeError, ValueError), r"device: ")

# -- Tensor, from_dlpack, reshape, partition, Partition ---------------------------------------

for i, bad in enumerate([[1, 2, 3], None, 5, "a", (1, 2), {"a": 1}, b"ab", 1.5]):
    case(f"Tensor-{i}-{type(bad).__name__}", lambda bad=bad: Tensor(bad), TypeError,
         r"Tensor: array must be a NumPy \(cpu\) or CuPy \(cuda\) array")
for d in ("float64", "bool", "complex64", "complex128", "int8", "uint8", "int16", "uint32",
          "uint64", "float128" if hasattr(np, "float128") else "longdouble", "U3", "O"):
    case(f"Tensor-dtype-{d}", lambda d=d: Tensor(np.zeros(3, d)), DTypeError,
         r"Tensor: dtype .* is not supported; use one of float32, float16, bfloat16, int32, int64")
for i, bad in enumerate([None, 5, "a", [1, 2]]):
    case(f"from_dlpack-{i}-{type(bad).__name__}", lambda bad=bad: Tensor.from_dlpack(bad),
         TypeError, r"from_dlpack: .*not a DLPack producer")
for d in ("float64", "bool", "int8", "uint16", "complex64"):
    case(f"from_dlpack-dtype-{d}", lambda d=d: Tensor.from_dlpack(np.zeros(3, d)), DTypeError,
         r"(Tensor|from_dlpack): ")
for i, bad in enumerate([(3, -1), (5, 5), (-1, -1), (2.5, 4), "12", None, (0, -1), (7,),
                         (-2, 6), (True, 12), [1.0, 12], (1, 2, "6")]):
    case(f"reshape-{i}-{bad!r}", lambda bad=bad: T((12,)).reshape(bad) if bad != (3, -1) else
         T((10,)).reshape(bad), ShapeError, r"reshape: ")
for i, bad in enumerate([(2.5, 4), (0, 4), (4,), "ab", None, (1, 1, 1), (-1, 2), (True, 2),
                         (2, None), 2.0]):
    case(f"partition-{i}-{bad!r}", lambda bad=bad: T((4, 4)).partition(bad), ShapeError,
         r"partition: tile shape")
case("Partition-not-tensor", lambda: Partition(np.zeros((2, 2)), (1, 1)), TypeError,  # type: ignore[arg-type]
     r"Partition: tensor must be a Tensor")
case("Partition-bad-tile", lambda: Partition(T((4, 4)), (2.5, 1)), ShapeError,  # type: ignore[arg-type]
     r"partition: tile shape")

# -- combinators -------------------------------------------------------------------------------


def _with_op(fn: Callable[[DeviceOp[Any]], Any]) -> Callable[[], Any]:
    def call() -> Any:
        op = api.ones((2,))
        try:
            return fn(op)
        finally:
            op._consume()

    return call


for i, bad in enumerate([None, 5, "f", [len], 1.5]):
    for comb in ("then", "map", "inspect"):
        case(f"{comb}-{i}-{bad!r}", _with_op(lambda op, comb=comb, bad=bad: getattr(op, comb)(bad)),
             TypeError, rf"{comb}: fn must be callable")
for i, bad in enumerate(["2", 2.0, True, None, [2]]):
    case(f"unzip-n{i}-{bad!r}", _with_op(lambda op, bad=bad: deviceops.unzip(op, bad)), TypeError,
         r"unzip: n must be an int")
for bad in (0, -1):
    case(f"unzip-n{bad}", _with_op(lambda op, bad=bad: deviceops.unzip(op, bad)), ValueError,
         r"unzip: n must be >= 1")
for i, bad in enumerate([5, None, (1, 2), api]):
    case(f"unzip-op{i}", lambda bad=bad: deviceops.unzip(bad, 2), TypeError,
         r"unzip: op must be a DeviceOp")
    case(f"zip-arg{i}", _with_op(lambda op, bad=bad: deviceops.zip(op, bad)), TypeError,
         r"zip: argument 1 is .* not a DeviceOp")
case("zip-same-twice", _with_op(lambda op: deviceops.zip(op, op)), SchedulingError, "passed twice")

# -- kernels -----------------------------------------------------------------------------------


@dataclass
class KernelSpec:
    """How to call one kernel validly, for the generated mutations.

    Attributes:
        name: the kernel's name (error messages start with it).
        fn: the launcher.
        valid: valid arguments, by name (positional order = dict order for ``positional``).
        positional: how many leading arguments are positional.
        tensors: the tensor arguments.
        optional: tensor arguments that may be ``None``.
        floats: tensor arguments that must be floating (an int32 one is refused).
        ints: tensor arguments that must be integer (a float32 one is refused).
        out: the output argument and its expected shape/dtype (for wrong-out mutations).
        contiguous: a tensor argument refused when non-contiguous, with its 2-D shape.
        scalars: ``{argument: [(bad value, exception, fragment)]}``.
        shapes: ``[(argument, bad tensor, fragment)]``: shape mismatches.
    """

    name: str
    fn: Callable[..., Any]
    valid: Callable[[], dict[str, Any]]
    positional: int
    tensors: tuple[str, ...]
    optional: tuple[str, ...] = ()
    floats: tuple[str, ...] = ()
    ints: tuple[str, ...] = ()
    out: tuple[str, tuple[int, ...], str] | None = None
    contiguous: tuple[str, tuple[int, int]] | None = None
    scalars: dict[str, list[tuple[Any, Any, str]]] = field(default_factory=dict)
    shapes: Callable[[], list[tuple[str, Any, str]]] = lambda: []

    def call(self, **override: Any) -> Any:
        args = {**self.valid(), **override}
        keys = list(args)
        pos = [args[k] for k in keys[: self.positional]]
        kw = {k: args[k] for k in keys[self.positional:]}
        return self.fn(*pos, **kw)


EPS_BAD = [(-1.0, ValueError, "eps"), (math.nan, ValueError, "eps"), (math.inf, ValueError, "eps"),
           ("1e-6", (TypeError, ValueError), "eps"), (None, TypeError, "")]


def _row(name: str, fn: Callable[..., Any], extra: dict[str, Callable[[], Any]] | None = None,
         **kw: Any) -> KernelSpec:
    ex = extra or {}
    return KernelSpec(name, fn, lambda: {"x": T((3, 5)), **{k: v() for k, v in ex.items()}},
                      1 + len(ex), ("x", *ex), floats=("x",), out=("out", (3, 5), "float32"),
                      contiguous=("x", (3, 5)), **kw)


KERNELS: list[KernelSpec] = [
    KernelSpec("saxpy", K.saxpy, lambda: {"z": T((3, 4)), "a": 2.0, "x": T((3, 4))}, 3, ("z", "x"),
               contiguous=("x", (3, 4)),
               scalars={"a": [(None, TypeError, "a must be a real number"),
                              ("2", TypeError, "a must be a real number"),
                              (True, TypeError, "a must be a real number"),
                              ([1], TypeError, "a must be a real number"),
                              (1e39, ValueError, "overflows float32")]},
               shapes=lambda: [("x", T((3, 5)), r"\(3, 4\).*\(3, 5\)"),
                               ("x", T((3, 4), "float16"), "dtype")]),
    KernelSpec("add", K.add, lambda: {"x": T((3, 4)), "y": T((3, 4)), "out": None}, 2,
               ("x", "y", "out"), optional=("out",), out=("out", (3, 4), "float32"),
               contiguous=("x", (3, 4)),
               shapes=lambda: [("y", T((3, 5)), r"\(3, 4\).*\(3, 5\)"),
                               ("y", T((3, 4), "int32"), "dtype")]),
    KernelSpec("mul", K.mul, lambda: {"x": T((3, 4)), "y": T((3, 4)), "out": None}, 2,
               ("x", "y", "out"), optional=("out",), out=("out", (3, 4), "float32"),
               contiguous=("y", (3, 4)),
               shapes=lambda: [("x", T((4, 3)), r"\(4, 3\)")]),
    KernelSpec("gemm", K.gemm, lambda: {"a": T((3, 4)), "b": T((4, 5)), "out": None, "bias": None},
               2, ("a", "b", "out", "bias"), optional=("out", "bias"), floats=("a",),
               out=("out", (3, 5), "float32"), contiguous=("a", (3, 4)),
               scalars={"activation": [("relu6", ValueError, "activation"), (5, ValueError, "activation")],
                        "alpha": [(math.nan, ValueError, "finite"), (math.inf, ValueError, "finite")],
                        "beta": [(math.nan, ValueError, "finite"), (1.0, ValueError, "out=")]},
               shapes=lambda: [("b", T((5, 5)), r"\(3, 4\).*\(5, 5\)|K"),
                               ("bias", T((4,)), "bias")]),
    KernelSpec("matmul", K.matmul, lambda: {"a": T((3, 4)), "b": T((4, 5)), "out": None}, 2,
               ("a", "b", "out"), optional=("out",), floats=("b",), out=("out", (3, 5), "float32"),
               contiguous=("b", (4, 5)), shapes=lambda: [("a", T((3, 5)), r"matmul")]),
    KernelSpec("flash_attention", K.flash_attention,
               lambda: {"q": T((1, 2, 3, 8)), "k": T((1, 2, 5, 8)), "v": T((1, 2, 5, 8)),
                        "out": None, "kv_len": None, "block_table": None},
               3, ("q", "k", "v", "out", "kv_len", "block_table"),
               optional=("out", "kv_len", "block_table"),
               out=("out", (1, 2, 3, 8), "float32"),
               scalars={"causal": [("no", TypeError, "causal must be a bool"),
                                   (1, TypeError, "causal must be a bool"),
                                   (None, TypeError, "causal must be a bool")],
                        "scale": [(math.nan, ValueError, "scale"), (math.inf, ValueError, "scale")]},
               shapes=lambda: [("k", T((1, 3, 5, 8)), r"flash_attention"),
                               ("v", T((1, 2, 4, 8)), r"flash_attention")]),
    _row("rms_norm", K.rms_norm, {"weight": lambda: T((5,))},
         scalars={"eps": EPS_BAD}, shapes=lambda: [("weight", T((4,)), r"weight.*\(4,\)")]),
    _row("layer_norm", K.layer_norm, {"weight": lambda: T((5,))},
         scalars={"eps": EPS_BAD}, shapes=lambda: [("weight", T((6,)), r"weight.*\(6,\)")]),
    _row("softmax", K.softmax),
    _row("gelu", K.gelu),
    _row("silu", K.silu),
    KernelSpec("argmax", K.argmax, lambda: {"x": T((3, 5)), "out": None}, 1, ("x", "out"),
               optional=("out",), floats=("x",), contiguous=("x", (3, 5)),
               scalars={"dtype": [("float32", DTypeError, "int32 or int64"),
                                  ("int8", DTypeError, "")]},
               shapes=lambda: [("out", T((5,), "int32"), r"out"),
                               ("out", T((3,), "float32"), r"out")]),
    KernelSpec("embedding", K.embedding, lambda: {"ids": T((2, 3), "int32", 1), "table": T((4, 5)),
                                                  "out": None},
               2, ("ids", "table", "out"), optional=("out",), ints=("ids",),
               out=("out", (2, 3, 5), "float32"), contiguous=("table", (4, 5)),
               shapes=lambda: [("table", T((20,)), r"table has shape \(20,\)")]),
    KernelSpec("swiglu", K.swiglu, lambda: {"gate_up": T((3, 8)), "out": None}, 1,
               ("gate_up", "out"), optional=("out",), floats=("gate_up",),
               out=("out", (3, 4), "float32"), contiguous=("gate_up", (3, 8)),
               shapes=lambda: [("gate_up", T((3, 7)), r"swiglu")]),
    KernelSpec("merge_heads", K.merge_heads, lambda: {"x": T((1, 2, 3, 4)), "out": None}, 1,
               ("x", "out"), optional=("out",), out=("out", (1, 3, 8), "float32"),
               shapes=lambda: [("x", T((2, 3, 4)), r"merge_heads")]),
    KernelSpec("rope", K.rope, lambda: {"x": T((2, 3, 4, 8)), "start": T((2,), "int32", 0),
                                        "out": None}, 2, ("x", "start", "out"),
               optional=("out",), floats=("x",), ints=("start",), out=("out", (2, 3, 4, 8), "float32"),
               scalars={"theta": [(0.0, ValueError, "theta"), (-1.0, ValueError, "theta"),
                                  (math.nan, ValueError, "theta")]},
               shapes=lambda: [("x", T((2, 3, 4, 7)), r"rope"), ("start", T((3,), "int32", 0), r"start")]),
    KernelSpec("add_rms_norm", K.add_rms_norm,
               lambda: {"x": T((3, 5)), "residual": T((3, 5), fill=0.25), "weight": T((5,)),
                        "out": None}, 3, ("x", "residual", "weight", "out"), optional=("out",),
               floats=("x",), out=("out", (3, 5), "float32"), contiguous=("x", (3, 5)),
               scalars={"eps": EPS_BAD[:3]},
               shapes=lambda: [("residual", T((3, 4)), r"add_rms_norm"), ("weight", T((4,)), r"weight")]),
    KernelSpec("sample", K.sample,
               lambda: {"logits": T((2, 7)), "temperature": T((2,), fill=1.0),
                        "top_k": T((2,), "int32", 0), "top_p": T((2,), fill=1.0),
                        "seed": T((2,), "int64", 1), "counter": T((2,), "int64", 0), "out": None},
               6, ("logits", "temperature", "top_k", "top_p", "seed", "counter", "out"),
               optional=("out",), floats=("logits",), ints=("top_k", "seed", "counter"),
               shapes=lambda: [("temperature", T((3,), fill=1.0), r"sample")]),
]

_BAD_TENSOR_VALUES: list[tuple[str, Any]] = [("int", 5), ("str", "x"), ("list", [1.0, 2.0]),
                                             ("ndarray", np.ones((3, 4), np.float32)),
                                             ("float", 1.5), ("dict", {"a": 1})]

for spec in KERNELS:
    for arg in spec.tensors:
        for tname, bad in _BAD_TENSOR_VALUES:
            case(f"kernels.{spec.name}-{arg}-{tname}", lambda spec=spec, arg=arg, bad=bad:
                 spec.call(**{arg: bad}), TypeError,
                 rf"{spec.name}: argument '{arg}' must be a Tensor, Partition or DeviceOp")
        if arg not in spec.optional:
            case(f"kernels.{spec.name}-{arg}-None", lambda spec=spec, arg=arg: spec.call(**{arg: None}),
                 TypeError, rf"{spec.name}: argument '{arg}' is required")
    for arg in spec.floats:
        for d in ("int32", "int64"):
            case(f"kernels.{spec.name}-{arg}-dtype-{d}",
                 lambda spec=spec, arg=arg, d=d: spec.call(**{arg: T(spec.valid()[arg].shape, d, 1)}),
                 DTypeError, rf"{spec.name}: .*{d}")
    for arg in spec.ints:
        for d in ("float32", "float16"):
            case(f"kernels.{spec.name}-{arg}-dtype-{d}",
                 lambda spec=spec, arg=arg, d=d: spec.call(**{arg: T(spec.valid()[arg].shape, d, 1)}),
                 DTypeError, rf"{spec.name}: .*{d}")
    if spec.out is not None:
        oname, oshape, odt = spec.out
        wrong_shape = (*oshape[:-1], oshape[-1] + 1)
        case(f"kernels.{spec.name}-out-shape", lambda spec=spec, oname=oname, s=wrong_shape:
             spec.call(**{oname: T(s)}), ShapeError, rf"{spec.name}: .*out")
        case(f"kernels.{spec.name}-out-dtype", lambda spec=spec, oname=oname, s=oshape:
             spec.call(**{oname: T(s, "float16")}), DTypeError, rf"{spec.name}: .*out")
    if spec.contiguous is not None:
        carg, cshape = spec.contiguous
        case(f"kernels.{spec.name}-{carg}-noncontiguous", lambda spec=spec, carg=carg, cshape=cshape:
             spec.call(**{carg: noncontig(cshape)}), ShapeError, rf"{spec.name}: .*contiguous")
    for sarg, bads in spec.scalars.items():
        for bad, exc, frag in bads:
            case(f"kernels.{spec.name}-{sarg}-{bad!r}", lambda spec=spec, sarg=sarg, bad=bad:
                 spec.call(**{sarg: bad}), exc, rf"{spec.name}: .*{frag}")
    for i, (sarg, bad_t, frag) in enumerate(spec.shapes()):
        case(f"kernels.{spec.name}-shape{i}-{sarg}", lambda spec=spec, sarg=sarg, bad_t=bad_t:
             spec.call(**{sarg: bad_t}), (ShapeError, DTypeError), frag)

for d in ("float32", "int64", "float16"):
    case(f"kernels.flash_attention-kv_len-dtype-{d}", lambda d=d: K.flash_attention(
        T((1, 2, 3, 8)), T((1, 2, 5, 8)), T((1, 2, 5, 8)), kv_len=T((1,), d, 1)), DTypeError,
        rf"flash_attention: .*kv_len.*{d}")

# int32 saxpy: a scalar the dtype cannot hold (issue: 1e12 gave INT_MIN on cpu, saturated on cuda)
for v in (1e12, -1e12, 2.0**31, math.nan, math.inf):
    case(f"kernels.saxpy-int32-a-{v!r}", lambda v=v: K.saxpy(T((3,), "int32"), v, T((3,), "int32")),
         ValueError, r"saxpy: a=.*(int32|finite)")


# -- the test ----------------------------------------------------------------------------------


def test_battery_is_large() -> None:
    assert len(CASES) >= 500, len(CASES)
    assert len({c.id for c in CASES}) == len(CASES), "duplicate case ids"


def _check(c: Case) -> str | None:
    """None if case ``c`` raised as expected, else what went wrong."""
    try:
        res = c.call()
    except BaseException as exc:
        if not isinstance(exc, c.exc):
            return f"{c.id}: raised {type(exc).__name__}: {exc}, expected {c.exc}"
        if not isinstance(exc, TypeError | ValueError | deviceops.DeviceError) or isinstance(
                exc, AssertionError | KeyError):
            return f"{c.id}: raised {type(exc).__name__}, not a TypeError/ValueError/DeviceError"
        if not re.search(c.match, str(exc), re.S):
            return f"{c.id}: message {str(exc)!r} does not match {c.match!r}"
        return None
    if isinstance(res, DeviceOp):
        res._consume()
    return f"{c.id}: accepted (returned {type(res).__name__}); expected {c.exc}"


# One test per group of cases (the part of the id before the first "-"): a failure lists
# every failing case of its group by id. (One test per case would be ~1,000 tests, and the
# suite's per-test garbage collection makes that slow.)
GROUPS: dict[str, list[Case]] = {}
for _c in CASES:
    GROUPS.setdefault(_c.id.split("-")[0], []).append(_c)


@pytest.mark.parametrize("group", list(GROUPS))
def test_bad_inputs(group: str) -> None:
    problems = [p for p in (_check(c) for c in GROUPS[group]) if p is not None]
    assert not problems, "\n".join(problems)


def test_oom_is_a_device_error_naming_bytes() -> None:
    with pytest.raises(deviceops.OutOfMemoryError) as info:
        api.zeros(1 << 45).sync()
    msg = str(info.value)
    assert "zeros: out of memory" in msg and "asked for 140,737,488,355,328 bytes" in msg, msg
    assert "free" in msg
    assert isinstance(info.value, deviceops.DeviceError | MemoryError)
