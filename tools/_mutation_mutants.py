"""The mutants of ``tools/mutation.py``: the cosmic-ray operators used and the statement
deletions, made for one module by :func:`make_mutants` (each a :class:`Mutant`: one change
at one place, lines the tests cannot see skipped, annotation-only changes dropped), and the
mutants issue 36 named (:data:`NAMED`, each a :class:`Named` text replacement with the fast
tests that must kill it).
"""

from __future__ import annotations

import ast
import difflib
import hashlib
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


# -- the named mutants (issue 36) ------------------------------------------------------------

@dataclass(frozen=True)
class Named:
    """One of the mutants issue 36 named: ``old`` replaced by ``new`` (exactly once) in
    ``module``; ``tests`` are the fast tests that must kill it."""

    name: str
    module: str
    old: str
    new: str
    tests: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()


_HTTP_STREAM = ("                s = engine.stream(job.ids, job.max_tokens, temperature=job.temperature,\n"
                "                                  top_k=job.top_k, top_p=job.top_p, seed=job.seed,\n"
                "                                  ignore_eos=job.ignore_eos, **job.features())")
_KV_WRITE = ("                k_cache[blk, :, p % s_len] = k[b, i]\n"
             "                v_cache[blk, :, p % s_len] = v[b, i]")
# the cpu float32 path's decode branch (a few tokens: plain indexing), kernels/transformer/_cpu.py
_FAST_WRITE = ("                    k_cache[blk_, :, p_ % s_len] = k[bi_, i_]\n"
               "                    v_cache[blk_, :, p_ % s_len] = v[bi_, i_]")
_SAMPLING = ("tests/test_sampling_effects.py",)
_PAGED = ("tests/test_paged_kv.py",)
_REFERENCE = (("DEVICEOPS_CPU_KERNELS", "reference"),)  # the cpu backend runs the references
NAMED: list[Named] = [
    Named("HTTP: top_k dropped", "nn/serving/http.py", "top_k=job.top_k, ", "", _SAMPLING),
    Named("HTTP: top_p dropped", "nn/serving/http.py", "top_p=job.top_p, ", "", _SAMPLING),
    Named("HTTP: seed dropped", "nn/serving/http.py", "seed=job.seed,\n", "\n", _SAMPLING),
    Named("HTTP: ignore_eos dropped", "nn/serving/http.py", "ignore_eos=job.ignore_eos, ", "",
          _SAMPLING),
    Named("HTTP: top_k, top_p, seed, ignore_eos all dropped", "nn/serving/http.py", _HTTP_STREAM,
          "                s = engine.stream(job.ids, job.max_tokens, temperature=job.temperature,\n"
          "                                  **job.features())",
          _SAMPLING),
    Named("HTTP: temperature forced to 0", "nn/serving/http.py", "temperature=job.temperature,",
          "temperature=0.0,", _SAMPLING),
    Named("HTTP: include_usage ignored", "nn/serving/http.py", "                if job.include_usage:",
          "                if False:", _SAMPLING),
    Named("HTTP: max_completion_tokens ignored", "nn/serving/openai.py",
          'key = "max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens"',
          'key = "max_tokens"', _SAMPLING),
    Named("Engine: ignores top_k/top_p", "nn/serving/engine.py",
          "params = SamplingParams(t, k, p, ", "params = SamplingParams(t, 0, 1.0, ", _SAMPLING),
    Named("paged KV (references): decode K/V one slot early at a block's last slot",
          "kernels/transformer/_reference.py", _KV_WRITE,
          "                o = p % s_len - (1 if l_ == 1 and p % s_len == s_len - 1 else 0)\n"
          "                k_cache[blk, :, o] = k[b, i]\n"
          "                v_cache[blk, :, o] = v[b, i]", _PAGED, _REFERENCE),
    Named("paged KV (references): V dropped at block ends", "kernels/transformer/_reference.py",
          _KV_WRITE,
          "                k_cache[blk, :, p % s_len] = k[b, i]\n"
          "                if p % s_len != s_len - 1:\n"
          "                    v_cache[blk, :, p % s_len] = v[b, i]", _PAGED, _REFERENCE),
    Named("paged KV (references): K dropped at block ends", "kernels/transformer/_reference.py",
          _KV_WRITE,
          "                if p % s_len != s_len - 1:\n"
          "                    k_cache[blk, :, p % s_len] = k[b, i]\n"
          "                v_cache[blk, :, p % s_len] = v[b, i]", _PAGED, _REFERENCE),
    Named("paged KV (references): attention reads the next block-table entry at block ends",
          "kernels/attention/_reference.py",
          "        ids = block_table[bi, :n_blk].astype(np.int64)",
          "        ids = block_table[bi, :n_blk].astype(np.int64)\n"
          "        if n_blk > 1 and int(lens[bi]) % bs == 0:\n"
          "            ids = np.roll(ids, 1)", _PAGED, _REFERENCE),
    Named("paged KV (cpu float32 path): decode K/V one slot early at a block's last slot",
          "kernels/transformer/_cpu.py", _FAST_WRITE,
          "                    o_ = p_ % s_len - (1 if l_ == 1 and p_ % s_len == s_len - 1 else 0)\n"
          "                    k_cache[blk_, :, o_] = k[bi_, i_]\n"
          "                    v_cache[blk_, :, o_] = v[bi_, i_]", _PAGED),
    Named("paged KV (cpu float32 path): V dropped at block ends", "kernels/transformer/_cpu.py",
          _FAST_WRITE,
          "                    k_cache[blk_, :, p_ % s_len] = k[bi_, i_]\n"
          "                    if p_ % s_len != s_len - 1:\n"
          "                        v_cache[blk_, :, p_ % s_len] = v[bi_, i_]", _PAGED),
    Named("zip: branch error hand-over removed", "deviceops/_combinators.py",
          "                ev.hand_over_error()  # the join takes the branch's error (cpu)\n", "",
          ("tests/test_error_delivery.py",)),
    Named("MultiDeviceRoundRobin: first device only", "scheduling/_policies.py",
          "        self.devices = tuple(devs)\n", "        devs = devs[:1]\n        self.devices = tuple(devs)\n",
          ("tests/test_multi_device.py",)),
]


# -- generated mutants ------------------------------------------------------------------------

# cosmic-ray operators used (its full set also swaps every arithmetic operator for every
# other one: ten mutants per '+', nearly all killed by the same tests as these)
_CMP = ["Eq_NotEq", "NotEq_Eq", "Lt_LtE", "Lt_GtE", "LtE_Lt", "LtE_Gt", "Gt_GtE", "Gt_LtE",
        "GtE_Gt", "GtE_Lt", "Is_IsNot", "IsNot_Is"]
_BIN = ["Add_Sub", "Sub_Add", "Mul_Div", "Div_Mul", "FloorDiv_Mul", "Mod_FloorDiv",
        "BitAnd_BitOr", "BitOr_BitAnd", "LShift_RShift", "RShift_LShift"]
OPERATORS = ([f"core/ReplaceComparisonOperator_{x}" for x in _CMP]
             + [f"core/ReplaceBinaryOperator_{x}" for x in _BIN]
             + ["core/ReplaceUnaryOperator_USub_UAdd", "core/ReplaceUnaryOperator_Delete_Not",
                "core/AddNot", "core/ReplaceTrueWithFalse", "core/ReplaceFalseWithTrue",
                "core/ReplaceAndWithOr", "core/ReplaceOrWithAnd", "core/ReplaceBreakWithContinue",
                "core/ReplaceContinueWithBreak", "core/NumberReplacer",
                "core/ZeroIterationForLoop", "core/ExceptionReplacer"])
DELETE = "deviceops/DeleteStatement"


@dataclass
class Mutant:
    module: str
    operator: str
    occurrence: int
    line: int
    before: str
    after: str
    code: str

    @property
    def key(self) -> str:
        h = hashlib.sha1(self.code.encode()).hexdigest()[:12]
        return f"{self.module}:{self.operator}:{self.occurrence}:{h}"


def _skip_lines(code: str) -> set[int]:
    """Lines no mutant is made on: logging, ``__all__``, ``TYPE_CHECKING`` blocks, ``__repr__``,
    ``Protocol`` classes (stubs that never run) and the ``cuda`` closures a launch is given
    (only a GPU runs them; the cpu suite cannot see them)."""
    tree = ast.parse(code)
    skip: set[int] = set()
    for node in ast.walk(tree):
        typing_only = isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        is_repr = isinstance(node, ast.FunctionDef) and node.name in ("__repr__", "cuda")
        is_all = isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)
        logging = (isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)
                   and ast.unparse(node.value.func).split(".")[0]
                   in ("log", "_log", "logger", "warnings"))
        protocol = isinstance(node, ast.ClassDef) and any(
            ast.unparse(b).split(".")[-1] == "Protocol" for b in node.bases)
        if typing_only or is_repr or is_all or logging or protocol:
            assert isinstance(node, ast.stmt)
            skip.update(range(node.lineno, (node.end_lineno or node.lineno) + 1))
    return skip


class _NoAnnotations(ast.NodeTransformer):
    """Drops annotations: under ``from __future__ import annotations`` they are strings never
    evaluated, so a mutant that changes only an annotation is equivalent by construction."""

    def visit_arg(self, node: ast.arg) -> ast.arg:
        node.annotation = None
        return node

    def visit_FunctionDef(self, node: ast.FunctionDef) -> ast.AST:
        node.returns = None
        self.generic_visit(node)
        return node

    def visit_AsyncFunctionDef(self, node: ast.AsyncFunctionDef) -> ast.AST:
        node.returns = None
        self.generic_visit(node)
        return node

    def visit_AnnAssign(self, node: ast.AnnAssign) -> ast.AST:
        node.annotation = ast.Constant(None)
        self.generic_visit(node)
        return node


def _semantic(code: str) -> str:
    return ast.dump(_NoAnnotations().visit(ast.parse(code)))


def _changed(code: str, new: str) -> tuple[int, str, str]:
    a, b = code.splitlines(), new.splitlines()
    for op in difflib.SequenceMatcher(a=a, b=b, autojunk=False).get_opcodes():
        if op[0] != "equal":
            return op[1] + 1, "\n".join(a[op[1]:op[2]]).strip(), "\n".join(b[op[3]:op[4]]).strip()
    return 0, "", ""


def _deletions(code: str) -> list[tuple[int, str]]:
    """(line, mutated code) for each call statement / attribute or item assignment deleted."""
    lines = code.splitlines(keepends=True)
    out = []
    for node in ast.walk(ast.parse(code)):
        call = isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)
        store = isinstance(node, ast.AugAssign | ast.Assign) and all(
            isinstance(t, ast.Attribute | ast.Subscript)
            for t in (node.targets if isinstance(node, ast.Assign) else [node.target]))
        if not (call or store):
            continue
        assert isinstance(node, ast.stmt)
        first, last = node.lineno - 1, (node.end_lineno or node.lineno) - 1
        head, tail = lines[first], lines[last]
        indent = len(head) - len(head.lstrip())
        if node.col_offset != indent or tail[node.end_col_offset:].strip() not in ("", "\\"):
            continue  # shares its line with other code
        new = [*lines[:first], " " * indent + "pass\n", *lines[last + 1:]]
        out.append((node.lineno, "".join(new)))
    return out


def make_mutants(module: str) -> list[Mutant]:
    try:
        from cosmic_ray.ast import ast_nodes, get_ast
        from cosmic_ray.mutating import mutate_code
        from cosmic_ray.plugins import get_operator
    except ImportError as exc:
        raise SystemExit(f"tools/mutation.py needs cosmic-ray ({exc}): pip install -e '.[test]'"
                         ) from None

    code = (ROOT / module).read_text()
    skip = _skip_lines(code)
    seen: set[str] = {code}
    lazy = "from __future__ import annotations" in code
    plain = _semantic(code) if lazy else ""
    out: list[Mutant] = []

    def add(op: str, occ: int, new: str | None) -> None:
        if new is None or new in seen:
            return
        line, before, after = _changed(code, new)
        if not line or line in skip:
            return
        try:
            compile(new, module, "exec")
        except SyntaxError:
            return
        seen.add(new)
        if lazy and _semantic(new) == plain:
            return  # an annotation only
        out.append(Mutant(module, op, occ, line, before, after, new))

    tree = get_ast(code)
    nodes = list(ast_nodes(tree))
    for name in OPERATORS:
        op = get_operator(name)()
        n = sum(1 for node in nodes for _ in op.mutation_positions(node))
        for occ in range(n):
            try:
                mutated = mutate_code(code, op, occ)
            except AttributeError:  # cosmic-ray's exception replacer on `except (A, b.C)`
                continue
            add(name, occ, mutated)
    for occ, (_line, new) in enumerate(_deletions(code)):
        add(DELETE, occ, new)
    return out
