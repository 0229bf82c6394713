"""Layering (issue 12): the core never imports the layers above it.

errors/dtypes -> backend -> streams, tensors, launch -> DeviceOp  are the core; scheduling,
api, kernels, the async bridge, graphs and nn sit above it and reach it through its
public names or the hooks of ``deviceops._hooks``. Imports under ``if TYPE_CHECKING:`` (type
names only) are allowed.
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


KERNEL_FILES = sorted(p.name for p in (ROOT / "kernels").glob("*.py"))


@pytest.mark.parametrize("name", KERNEL_FILES)
def test_kernels_reach_the_core_through_the_extension_interface(name: str) -> None:
    """``deviceops.kernels`` imports the core only through ``deviceops.extend`` (and the
    public ``deviceops`` names), never a private core module."""
    tree = ast.parse((ROOT / "kernels" / name).read_text())
    absolute = [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and not n.level]
    bad = [f"line {n.lineno}: {n.module}" for n in absolute
           if (n.module or "").startswith("deviceops._")]
    bad += [f"line {n.lineno}: from deviceops import {a.name}" for n in absolute
            if n.module == "deviceops" for a in n.names if a.name.startswith("_")]
    bad += [f"line {n.lineno}: import {a.name}" for n in ast.walk(tree) if isinstance(n, ast.Import)
            for a in n.names if a.name.startswith("deviceops._")]
    assert not bad, f"kernels/{name} imports private core modules (use deviceops.extend): {bad}"


def test_extension_interface_exports_what_it_lists() -> None:
    import deviceops.extend as ext

    missing = [n for n in ext.__all__ if not hasattr(ext, n)]
    assert not missing and ext.__doc__ and "launch" in ext.__doc__
