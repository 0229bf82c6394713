"""compute-sanitizer sweep over every kernel in ``deviceops.kernels`` (GPU only).

Usage::

    python3 tools/sanitize_all.py [--tools memcheck,racecheck,synccheck,initcheck]
                                  [--only NAME[,NAME]] [--timeout 600] [--json PATH]

Runs this file once per sanitizer tool under ``compute-sanitizer --tool T
--error-exitcode 3`` (the *worker*, ``--worker``): the worker launches every kernel
listed in ``deviceops.kernels.__all__`` on odd shapes (row tails, partial tiles,
lengths that are not multiples of a warp) in float32, float16 and bfloat16 (int32/int64
where the kernel takes integers), checks each result against the same op on the ``cpu``
backend (the float64 NumPy reference), and prints one line per case. The driver prints a
summary per tool and kernel: cases run, sanitizer errors (``ERROR SUMMARY``), mismatches,
and kernels that have no case here (a kernel added later without a case is listed as
``NO CASE``, never silently skipped). Exit status 0 when every tool reports 0 errors and
every result matches.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TOOLS = ("memcheck", "racecheck", "synccheck", "initcheck")
FLOATS = ("float32", "float16", "bfloat16")
NOT_KERNELS = {"KernelOp", "reserve_workspace", "slow_copy"}

# -- cases: name -> builder(rng, dtype) -> list of (label, make_op(backend_tensors), inputs) ----
# A builder returns host inputs (NumPy arrays) and a function building the op from tensors
# on one device; the worker runs it on cuda and on cpu and compares.

Case = tuple[str, dict[str, np.ndarray], Callable[[dict[str, Any]], Any]]


def _f(rng: np.random.Generator, shape: tuple[int, ...], dt: str, scale: float = 1.0) -> np.ndarray:
    import ml_dtypes

    npdt = np.dtype(ml_dtypes.bfloat16) if dt == "bfloat16" else np.dtype(dt)
    return (rng.standard_normal(shape) * scale).astype(npdt)


def _cases(name: str, rng: np.random.Generator, dt: str) -> list[Case] | None:
    from deviceops import kernels as K

    f = lambda *s, scale=1.0: _f(rng, s, dt, scale)  # noqa: E731
    i32 = lambda a: np.asarray(a, np.int32)  # noqa: E731
    out: list[Case] = []
    if name in ("add", "mul"):
        fn = getattr(K, name)
        for shp in [(1,), (257,), (33, 65), (3, 5, 7)]:
            out.append((f"{shp}", {"x": f(*shp), "y": f(*shp)}, lambda t, fn=fn: fn(t["x"], t["y"])))
        out.append(("partition (37, 45)/(8, 16)", {"x": f(37, 45), "y": f(37, 45), "o": f(37, 45)},
                    lambda t, fn=fn: fn(t["x"], t["y"], out=t["o"].partition((8, 16)))))
    elif name == "saxpy":
        for shp in [(1,), (1000,), (33, 65)]:
            out.append((f"{shp}", {"z": f(*shp), "x": f(*shp)}, lambda t: K.saxpy(t["z"], 1.5, t["x"])))
    elif name in ("gemm", "matmul"):
        for m, n, k in [(1, 8, 8), (5, 3, 7), (33, 17, 129), (67, 136, 200)]:
            ins = {"a": f(m, k, scale=0.5), "b": f(k, n, scale=0.5), "bias": f(n)}
            if name == "gemm":
                out.append((f"{m}x{n}x{k} bias gelu", ins, lambda t: K.gemm(t["a"], t["b"], bias=t["bias"],
                                                                              activation="gelu")))
            else:
                out.append((f"{m}x{n}x{k}", ins, lambda t: K.matmul(t["a"], t["b"])))
        if name == "gemm":
            out.append(("batched (3, 5, 24)@(24, 40) trans_b", {"a": f(3, 5, 24), "b": f(40, 24)},
                        lambda t: K.gemm(t["a"], t["b"], trans_b=True)))
            # the GEMV's cluster paths (sm_90): 8 and 2 slices of K, odd K, strip tails
            for m, n, k in [(1, 1000, 1543), (3, 264, 300)]:
                ins = {"a": f(m, k, scale=0.5), "b": f(k, n, scale=0.5), "bias": f(n)}
                out.append((f"gemv {m}x{n}x{k} bias gelu", ins, lambda t: K.gemm(
                    t["a"], t["b"], bias=t["bias"], activation="gelu")))
    elif name == "flash_attention":
        for b, hq, hkv, lq, lk, d, causal in [(1, 2, 1, 5, 37, 64, True), (2, 4, 2, 1, 70, 128, False),
                                              (1, 1, 1, 33, 33, 64, True)]:
            ins = {"q": f(b, hq, lq, d), "k": f(b, hkv, lk, d), "v": f(b, hkv, lk, d)}
            out.append((f"B{b} Hq{hq} Hkv{hkv} Lq{lq} Lk{lk} D{d} causal={causal}", ins,
                        lambda t, c=causal: K.flash_attention(t["q"], t["k"], t["v"], causal=c)))
        ins = {"q": f(2, 2, 1, 64), "k": f(2, 2, 50, 64), "v": f(2, 2, 50, 64), "kv_len": i32([17, 50])}
        out.append(("decode kv_len", ins, lambda t: K.flash_attention(t["q"], t["k"], t["v"],
                                                                     kv_len=t["kv_len"])))
        ins = {"q": f(2, 2, 1, 64), "k": f(6, 2, 16, 64), "v": f(6, 2, 16, 64),
               "kv_len": i32([20, 45]), "bt": i32([[1, 3, 5], [2, 4, 0]])}
        out.append(("decode paged (pool 6x16, table 2x3)", ins, lambda t: K.flash_attention(
            t["q"], t["k"], t["v"], kv_len=t["kv_len"], block_table=t["bt"])))
        # wide split-KV blocks (16-bit): 16 warps unsplit (66 pairs), 16 warps split (8 pairs)
        for b, hq, hkv, lk, d in [(22, 9, 3, 300, 64), (1, 32, 8, 4100, 128)]:
            ins = {"q": f(b, hq, 1, d), "k": f(b, hkv, lk, d), "v": f(b, hkv, lk, d),
                   "kv_len": i32([lk - 7 * (i % 3) for i in range(b)])}
            out.append((f"decode wide B{b} Hq{hq} Hkv{hkv} Lk{lk} D{d} kv_len", ins, lambda t: K.flash_attention(
                t["q"], t["k"], t["v"], kv_len=t["kv_len"])))
        # split partials merged in a thread-block cluster (sm_90, head dim 64): 8 and 4 splits,
        # rows with fewer valid keys than splits, and a paged cache
        for b, hq, hkv, lk in [(1, 9, 3, 1000), (6, 9, 3, 600)]:
            ins = {"q": f(b, hq, 1, 64), "k": f(b, hkv, lk, 64), "v": f(b, hkv, lk, 64),
                   "kv_len": i32([max(1, lk - 250 * i) for i in range(b)])}
            out.append((f"decode cluster B{b} Hq{hq} Hkv{hkv} Lk{lk} D64 kv_len", ins,
                        lambda t: K.flash_attention(t["q"], t["k"], t["v"], kv_len=t["kv_len"])))
        ins = {"q": f(2, 9, 1, 64), "k": f(40, 3, 16, 64), "v": f(40, 3, 16, 64),
               "kv_len": i32([600, 130]), "bt": i32([[(7 * j) % 40 for j in range(40)]] * 2)}
        out.append(("decode cluster paged (pool 40x16, table 2x40)", ins, lambda t: K.flash_attention(
            t["q"], t["k"], t["v"], kv_len=t["kv_len"], block_table=t["bt"])))
    elif name in ("rms_norm", "layer_norm"):
        fn = getattr(K, name)
        for r, c in [(1, 1), (3, 37), (5, 1000), (2, 4099)]:
            ins = {"x": f(r, c), "w": f(c)}
            out.append((f"({r}, {c})", ins, lambda t, fn=fn: fn(t["x"], t["w"])))
    elif name in ("softmax", "gelu", "silu"):
        fn = getattr(K, name)
        for shp in [(1, 1), (3, 37), (5, 1000), (2, 4099)]:
            out.append((f"{shp}", {"x": f(*shp)}, lambda t, fn=fn: fn(t["x"])))
    elif name == "argmax":
        for shp in [(1, 1), (3, 37), (2, 5000)]:
            out.append((f"{shp}", {"x": f(*shp)}, lambda t: K.argmax(t["x"])))
    elif name == "embedding":
        for n_ids, v, d in [(1, 3, 1), (7, 50, 33), (5, 1000, 129)]:
            ids = rng.integers(-2, v + 2, size=(n_ids,)).astype(np.int32)  # out of range: clamped
            out.append((f"ids {n_ids} table ({v}, {d})", {"ids": ids, "table": f(v, d)},
                        lambda t: K.embedding(t["ids"], t["table"])))
    elif name == "swiglu":
        for shp in [(1, 2), (7, 10), (3, 2 * 1001)]:
            out.append((f"{shp}", {"x": f(*shp)}, lambda t: K.swiglu(t["x"])))
    elif name == "merge_heads":
        for shp in [(1, 1, 1, 8), (2, 3, 5, 16)]:
            out.append((f"{shp}", {"x": f(*shp)}, lambda t: K.merge_heads(t["x"])))
    elif name == "rope":
        for b, length, h, d in [(1, 1, 1, 2), (2, 5, 3, 64)]:
            out.append((f"({b}, {length}, {h}, {d})", {"x": f(b, length, h, d), "s": i32(range(b))},
                        lambda t: K.rope(t["x"], t["s"])))
    elif name == "rope_kv_write":
        b, length, hq, hkv, d, s = 2, 3, 4, 2, 16, 9
        ins = {"qkv": f(b, length, (hq + 2 * hkv) * d), "s": i32([0, 7]),
               "k": f(b, hkv, s, d), "v": f(b, hkv, s, d)}
        out.append(("B2 L3 Hq4 Hkv2 D16 S9 (one row past the end)", ins,
                    lambda t: K.rope_kv_write(t["qkv"], t["s"], t["k"], t["v"], n_heads=hq,
                                              n_kv_heads=hkv).map(
                        lambda q, t=t: (q, t["k"], t["v"]))))  # the caches are compared too
        ins = {"qkv": f(b, length, (hq + 2 * hkv) * d), "s": i32([0, 7]),
               "k": f(6, hkv, 4, d), "v": f(6, hkv, 4, d), "bt": i32([[1, 3, 5], [2, 4, 0]])}
        out.append(("paged: pool 6x4, table 2x3", ins,
                    lambda t: K.rope_kv_write(t["qkv"], t["s"], t["k"], t["v"], n_heads=hq,
                                              n_kv_heads=hkv, block_table=t["bt"]).map(
                        lambda q, t=t: (q, t["k"], t["v"]))))
    elif name == "add_rms_norm":
        for r, c in [(1, 1), (3, 37), (2, 4099)]:
            ins = {"x": f(r, c), "res": f(r, c), "w": f(c)}
            out.append((f"({r}, {c})", ins, lambda t: K.add_rms_norm(t["x"], t["res"], t["w"])))
    elif name == "sample":
        b, v = 3, 1001
        ins = {"logits": f(b, v), "temp": np.array([0.0, 0.7, 1.3], np.float32),
               "k": i32([0, 5, 40]), "p": np.array([1.0, 0.9, 0.5], np.float32),
               "seed": np.array([1, 2, 3], np.int64), "ctr": np.array([0, 4, 9], np.int64)}
        out.append((f"({b}, {v})", ins, lambda t: K.sample(t["logits"], t["temp"], t["k"], t["p"],
                                                          t["seed"], t["ctr"])))
    else:
        return None
    return out


def _close(got: np.ndarray, want: np.ndarray, dt: str) -> bool:
    if got.shape != want.shape:
        return False
    if got.dtype.kind in "iu":
        return bool(np.array_equal(got, want))
    g, w = got.astype(np.float64), want.astype(np.float64)
    tol = {"float32": 2e-3, "float16": 2e-2, "bfloat16": 8e-2}[dt]
    return bool(np.all(np.abs(g - w) <= tol * (1.0 + np.abs(w))))


def worker(only: set[str]) -> int:
    import deviceops
    from deviceops import api, kernels

    cpu = deviceops.device("cpu")
    # (dry run of the cases without a GPU: both sides on the cpu backend)
    cuda = cpu if os.environ.get("SANITIZE_DRY_CPU") else deviceops.device(0)
    sc, sh = cuda.new_stream(), cpu.new_stream()
    rng = np.random.default_rng(16)
    names = [n for n in kernels.__all__ if n not in NOT_KERNELS and (not only or n in only)]
    bad = 0
    for name in names:
        for dt in FLOATS:
            cases = _cases(name, rng, dt)
            if cases is None:
                print(f"CASE {name} {dt} NO CASE", flush=True)
                break
            for label, ins, make in cases:
                outs = []
                for _dev, s in ((cuda, sc), (cpu, sh)):
                    ts = {k: api.from_host(v).sync_on(s) for k, v in ins.items()}
                    try:
                        res = make(ts).sync_on(s)
                    except Exception as exc:
                        res = exc
                    outs.append(_host(res, s))
                ok = not isinstance(outs[0], Exception) and not isinstance(outs[1], Exception) and \
                    len(outs[0]) == len(outs[1]) and all(_close(g, w, dt) for g, w in zip(*outs, strict=True))
                bad += not ok
                why = "" if ok else f" {outs[0]!r:.200} vs {outs[1]!r:.200}"
                print(f"CASE {name} {dt} {label} {'OK' if ok else 'MISMATCH'}{why}", flush=True)
    return 1 if bad else 0


def _host(res: Any, s: Any) -> Any:
    from deviceops import Partition, Tensor, api

    if isinstance(res, Exception):
        return res
    items = res if isinstance(res, tuple) else (res,)
    out = []
    for r in items:
        t = r.tensor if isinstance(r, Partition) else r
        if isinstance(t, Tensor):
            out.append(np.asarray(api.to_host(t).sync_on(s)))
    return out


def driver(tools: list[str], only: str, timeout: float, json_path: str | None) -> int:
    cs = shutil.which("compute-sanitizer") or "/usr/local/cuda/bin/compute-sanitizer"
    if not os.path.exists(cs):
        print(f"compute-sanitizer not found (looked for {cs})")
        return 2
    summary: dict[str, Any] = {}
    status = 0
    for tool in tools:
        cmd = [cs, "--tool", tool, "--error-exitcode", "3", "--print-limit", "20"]
        if tool == "racecheck":
            cmd += ["--racecheck-report", "all"]
        cmd += [sys.executable, __file__, "--worker"] + (["--only", only] if only else [])
        t0 = time.time()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
            text, rc = proc.stdout + proc.stderr, proc.returncode
        except subprocess.TimeoutExpired as exc:
            text = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
            rc = -1
        m = re.search(r"ERROR SUMMARY: (\d+) error", text)
        if m is None:  # racecheck: "RACECHECK SUMMARY: N hazards displayed (E errors, W warnings)"
            m = re.search(r"RACECHECK SUMMARY: \d+ hazards? displayed \((\d+) errors?", text)
        errors = int(m.group(1)) if m else (0 if rc == 0 else None)  # --error-exitcode 3
        cases = re.findall(r"^CASE (\S+) (\S+) (.*) (OK|MISMATCH|NO CASE)", text, re.M)
        nocase = sorted({c[0] for c in re.findall(r"^CASE (\S+) (\S+) NO CASE", text, re.M)})
        per: dict[str, dict[str, int]] = {}
        for kname, _dt, _label, verdict in cases:
            d = per.setdefault(kname, {"ok": 0, "mismatch": 0})
            d["ok" if verdict == "OK" else "mismatch"] += verdict != "NO CASE"
        summary[tool] = {"rc": rc, "errors": errors, "seconds": round(time.time() - t0, 1),
                         "kernels": per, "no_case": nocase,
                         "first_errors": re.findall(r"^=+ (?:ERROR|Error|Race).*$", text, re.M)[:10]}
        ok = rc == 0 and errors == 0 and all(d["mismatch"] == 0 for d in per.values())
        status |= not ok
        print(f"== {tool}: {'PASS' if ok else 'FAIL'} rc={rc} sanitizer errors={errors} "
              f"cases={sum(d['ok'] + d['mismatch'] for d in per.values())} "
              f"mismatches={sum(d['mismatch'] for d in per.values())} "
              f"({summary[tool]['seconds']} s)" + (f" NO CASE: {nocase}" if nocase else ""))
        for kname, d in sorted(per.items()):
            print(f"   {kname:16s} ok={d['ok']:3d} mismatch={d['mismatch']}")
        for line in summary[tool]["first_errors"]:
            print(f"   {line}")
        if rc == -1:
            print(f"   timed out after {timeout} s; the last lines:\n{text[-2000:]}")
        elif not ok and errors is None:
            print(text[-3000:])
    if json_path:
        Path(json_path).write_text(json.dumps(summary, indent=1))
    return status


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--tools", default=",".join(TOOLS))
    p.add_argument("--only", default="", help="comma-separated kernel names")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per tool")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    if a.worker:
        return worker({n for n in a.only.split(",") if n})
    return driver([t for t in a.tools.split(",") if t], a.only, a.timeout, a.json)


if __name__ == "__main__":
    sys.exit(main())
