"""Layering (issue 12): the core never imports the layers above it.

errors/dtypes -> backend -> streams, tensors, launch -> DeviceOp  are the core; scheduling,
api, kernels, the async bridge, graphs and nn sit above it and reach it through its
public names or the hooks of ``deviceops._hooks``. Imports under ``if TYPE_CHECKING:`` (type
names only) are allowed.

``deviceops.nn`` (issue 32) reaches the rest of the library only through its public API:
``deviceops`` (public names, and ``deviceops._env`` for environment knobs),
``deviceops.api``, ``deviceops.kernels``, ``deviceops.scheduling`` and ``deviceops.graphs``;
the one exception is ``nn/_precompile.py`` (see ``NN_PRIVATE_OK``). Inside ``nn`` the layers
go bottom to top: ``layers`` < ``models`` (architectures) < ``runner`` (device state, step
API) < the model layer (``tokenizer``, ``checkpoint``, ``model``, ``static_batch``,
``load``) < ``serving``. ``models`` imports only ``layers`` and itself; ``runner`` only
``layers``, ``models``, ``_args`` and itself; nothing below ``serving`` imports it (the
package ``__init__`` re-exports the serving names lazily, through ``importlib``; the
``serve`` entry module is the command, part of serving).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CORE = ["_backend", "_capture", "_combinators", "_completion", "_context", "_cpu_backend", "_cpu_stream",
        "_cuda_backend", "_device", "_dot", "_dtypes", "_errors", "_future", "_hooks", "_launch",
        "_op", "_storage", "_stream", "_tensor", "_trace"]
UPPER = ("deviceops.scheduling", "deviceops.graphs", "deviceops.kernels", "deviceops.nn",
         "deviceops.api", "deviceops._api_op", "deviceops._copies", "deviceops._async")
RELATIVE_UPPER = ("scheduling", "graphs", "kernels", "nn", "api", "_api_op", "_copies", "_async")


def _imports(tree: ast.AST) -> list[tuple[int, str]]:
    out: list[tuple[int, str]] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for n in node.orelse:
                visit(n)
            return
        if isinstance(node, ast.Import):
            out.extend((node.lineno, a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if node.level:  # relative: "from .x import y" / "from . import x"
                names = [mod] if mod else [a.name for a in node.names]
                out.extend((node.lineno, "deviceops." + n) for n in names)
            else:
                out.append((node.lineno, mod))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return out


@pytest.mark.parametrize("module", CORE)
def test_core_module_does_not_import_upper_layers(module: str) -> None:
    path = ROOT / "deviceops" / f"{module}.py"
    bad = [f"line {ln}: {name}" for ln, name in _imports(ast.parse(path.read_text()))
           if name.startswith(UPPER) or (name.split(".")[-1] in RELATIVE_UPPER and
           name.startswith("deviceops.") and name.count(".") == 1)]
    assert not bad, f"deviceops/{module}.py imports layers above the core: {bad}"


def test_backend_interface_sits_below_streams_and_tensors() -> None:
    """``_backend`` (the interface) depends on errors and dtypes only: streams, tensors and
    devices are type names there (``TYPE_CHECKING``), so every core module may import it."""
    path = ROOT / "deviceops" / "_backend.py"
    core = [name for _, name in _imports(ast.parse(path.read_text()))
            if name.startswith("deviceops")]
    assert set(core) <= {"deviceops._errors", "deviceops._dtypes"}, core


def test_hooks_are_installed_by_importing_deviceops() -> None:
    import deviceops  # noqa: F401
    from deviceops import _hooks

    for name in ("current_policy", "await_op", "await_future", "capture", "to_host"):
        assert getattr(_hooks, name).__module__ != "deviceops._hooks", name


def test_unknown_hook_is_refused() -> None:
    from deviceops import _hooks

    with pytest.raises(ValueError, match="unknown hook"):
        _hooks.install(nope=lambda: None)


KERNEL_FILES = sorted(str(p.relative_to(ROOT / "kernels")) for p in (ROOT / "kernels").rglob("*.py"))
KERNEL_FAMILIES = sorted(p.parent.name for p in (ROOT / "kernels").glob("*/__init__.py")
                         if p.parent.name != "runtime")
# The core modules kernels may name besides deviceops.extend: the environment-knob table.
KERNEL_CORE_ALLOWED = {"deviceops._env"}


@pytest.mark.parametrize("name", KERNEL_FILES)
def test_kernels_reach_the_core_through_the_extension_interface(name: str) -> None:
    """``deviceops.kernels`` imports the core only through ``deviceops.extend`` (and the
    public ``deviceops`` names, and ``deviceops._env``, the knob table), never another private
    core module."""
    tree = ast.parse((ROOT / "kernels" / name).read_text())
    absolute = [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and not n.level]
    bad = [f"line {n.lineno}: {n.module}" for n in absolute
           if (n.module or "").startswith("deviceops._") and n.module not in KERNEL_CORE_ALLOWED]
    bad += [f"line {n.lineno}: from deviceops import {a.name}" for n in absolute
            if n.module == "deviceops" for a in n.names
            if a.name.startswith("_") and f"deviceops.{a.name}" not in KERNEL_CORE_ALLOWED]
    bad += [f"line {n.lineno}: import {a.name}" for n in ast.walk(tree) if isinstance(n, ast.Import)
            for a in n.names if a.name.startswith("deviceops._")]
    assert not bad, f"kernels/{name} imports private core modules (use deviceops.extend): {bad}"


def _kernel_imports(path: Path) -> list[tuple[int, str]]:
    """The ``deviceops.kernels...`` modules a file under ``kernels/`` imports, absolute."""
    pkg = ["deviceops", "kernels", *path.parent.relative_to(ROOT / "kernels").parts]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg[: len(pkg) - node.level + 1]
                mods = [".".join([*base, node.module])] if node.module else [
                    ".".join([*base, a.name]) for a in node.names]
            else:
                mods = [node.module or ""]
            out += [(node.lineno, m) for m in mods]
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
    return [(ln, m) for ln, m in out if m.startswith("deviceops.kernels")]


@pytest.mark.parametrize("family", [*KERNEL_FAMILIES, "runtime"])
def test_kernel_families_import_only_the_runtime_and_themselves(family: str) -> None:
    """The rule of ``kernels/``: a family (``gemm``, ``attention``, ``norms``, ...) imports
    ``deviceops.kernels.runtime``, its own modules, and the core's extension interface
    (``deviceops.extend``, the public ``deviceops`` names, ``deviceops._env``: checked above),
    never another family; the runtime imports no family. What the families share (kernel
    specs, the plan cache, the driver launcher, row-kernel geometry, shared checks, the cpu
    backend's mode and activations) lives in the runtime for that reason."""
    own = f"deviceops.kernels.{family}"
    allowed = (own, "deviceops.kernels.runtime")
    bad = []
    for path in sorted((ROOT / "kernels" / family).rglob("*.py")):
        for ln, mod in _kernel_imports(path):
            if not (mod == own or mod.startswith(own + ".") or mod.startswith(allowed[1])):
                bad.append(f"{path.relative_to(ROOT)}:{ln}: {mod}")
    assert not bad, f"kernels/{family} imports outside its family and the runtime: {bad}"


def test_kernel_families_have_the_same_parts() -> None:
    """Every family names its parts alike: ``op.py``, and where the part exists ``_check.py``,
    ``_plan.py``, ``_cuda.py``, ``_reference.py``, ``_cpu.py`` (no other module names), and its
    CUDA sources sit in its own folder."""
    parts = {"__init__.py", "op.py", "_check.py", "_plan.py", "_cuda.py", "_reference.py", "_cpu.py",
             "_precompile.py"}
    for family in KERNEL_FAMILIES:
        names = {p.name for p in (ROOT / "kernels" / family).glob("*.py")}
        assert "op.py" in names and names <= parts, (family, sorted(names - parts))
        assert list((ROOT / "kernels" / family).glob("*.cu")), family


def test_no_kernel_module_over_500_lines() -> None:
    long = {n: c for n in KERNEL_FILES
            if (c := len((ROOT / "kernels" / n).read_text().splitlines())) > 500}
    assert not long, long


def test_extension_interface_exports_what_it_lists() -> None:
    import deviceops.extend as ext

    missing = [n for n in ext.__all__ if not hasattr(ext, n)]
    assert not missing and ext.__doc__ and "launch" in ext.__doc__


NN = ROOT / "nn"
NN_FILES = sorted(str(p.relative_to(NN)) for p in NN.rglob("*.py"))
NN_PUBLIC = ("deviceops", "deviceops.api", "deviceops.kernels", "deviceops.scheduling",
             "deviceops.graphs", "deviceops._env")
# the precompile command's workload compiles every GEMM variant through kernels' own
# variant list and compiler (deviceops/precompile.py is its entry point)
NN_PRIVATE_OK = {"_precompile.py"}


def _nn_module_imports(rel: str) -> list[tuple[int, str, list[str]]]:
    """``(line, absolute module, names)`` of every import of ``nn/<rel>`` outside ``if
    TYPE_CHECKING:``, relative imports resolved against the file's package."""
    parts = ["deviceops", "nn", *rel[:-3].split("/")]
    package = parts if parts[-1] == "__init__" else parts[:-1]
    if package[-1] == "__init__":
        package = package[:-1]
    out: list[tuple[int, str, list[str]]] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for n in node.orelse:
                visit(n)
            return
        if isinstance(node, ast.Import):
            out.extend((node.lineno, a.name, []) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            names = [a.name for a in node.names]
            if node.level:
                base = package[: len(package) - node.level + 1]
                if node.module:
                    out.append((node.lineno, ".".join([*base, node.module]), names))
                else:  # "from . import x": x is a module of the package (or a name of it)
                    out.extend((node.lineno, ".".join([*base, n]), []) for n in names)
            else:
                out.append((node.lineno, node.module or "", names))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse((NN / rel).read_text()))
    return out


def _nn_layer(module: str) -> str:
    """The nn layer a ``deviceops.nn...`` module belongs to."""
    parts = module.split(".")[2:]
    head = parts[0] if parts else "__init__"
    if head in ("layers", "models", "runner", "serving", "_args"):
        return head
    return "serving" if head == "serve" else "model"


NN_MAY_IMPORT = {  # layer -> the nn layers it may import
    "layers": {"layers"},
    "_args": {"_args"},
    "models": {"layers", "models"},
    "runner": {"layers", "models", "runner", "_args"},
    "model": {"layers", "models", "runner", "_args", "model"},
    "serving": {"layers", "models", "runner", "_args", "model", "serving"},
}


@pytest.mark.parametrize("rel", NN_FILES)
def test_nn_reaches_deviceops_through_its_public_api(rel: str) -> None:
    bad = []
    for line, mod, names in _nn_module_imports(rel):
        if not mod.startswith("deviceops") or mod.startswith("deviceops.nn"):
            continue
        if rel in NN_PRIVATE_OK:
            continue
        if mod not in NN_PUBLIC:
            bad.append(f"line {line}: {mod}")
        elif mod == "deviceops":
            bad += [f"line {line}: from deviceops import {n}" for n in names
                    if n.startswith("_") and n != "_env"]
    assert not bad, f"nn/{rel} imports private deviceops modules ({NN_PUBLIC} only): {bad}"


@pytest.mark.parametrize("rel", NN_FILES)
def test_nn_layers_import_only_those_below(rel: str) -> None:
    own = _nn_layer("deviceops.nn." + rel[:-3].replace("/", "."))
    if rel == "__init__.py":
        own = "model"  # re-exports the model layer; serving only lazily (importlib)
    allowed = NN_MAY_IMPORT[own]
    bad = [f"line {line}: {mod} ({_nn_layer(mod)})"
           for line, mod, _ in _nn_module_imports(rel)
           if mod.startswith("deviceops.nn") and _nn_layer(mod) not in allowed]
    assert not bad, f"nn/{rel} ({own} layer) imports layers above it: {bad}"


def test_importing_nn_does_not_import_serving() -> None:
    import subprocess
    import sys

    code = ("import sys, deviceops.nn as nn; nn.CausalLM; "
            "bad = [m for m in sys.modules if m.startswith(('deviceops.nn.serving', "
            "'starlette', 'uvicorn', 'ray'))]; assert not bad, bad; "
            "assert nn.Engine.__module__ == 'deviceops.nn.serving.engine'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
