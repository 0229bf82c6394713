"""The split-KV decode configuration of ``benchmarks/attention.py``: the
:class:`AttentionOverride` the script installs process-wide (:func:`current`,
:func:`set_overrides`), the ``--decode-defines`` variant knobs (:func:`apply_variant`) and the
choice of the best variant from a ``--decode-sweep`` (:func:`best_variant`)."""

from __future__ import annotations

import statistics
from dataclasses import replace
from typing import Any

from deviceops.kernels.attention import AttentionOverride
from deviceops.kernels.runtime import _override


def current() -> AttentionOverride:
    """The attention override this benchmark has installed (the planner's choices when none)."""
    return _override.active(AttentionOverride) or AttentionOverride()


def set_overrides(ov: AttentionOverride) -> AttentionOverride:
    """Install ``ov`` process-wide (this script times one configuration at a time); return the
    previous one."""
    prev = current()
    _override.installed[AttentionOverride] = ov
    return prev


def apply_variant(var: str) -> None:
    """Set a split-KV variant: ``min_steps=N`` / ``target=N`` / ``warps=N`` / ``cluster=N`` /
    ``bulk=N`` knobs (the :class:`AttentionOverride` fields)."""
    knobs = {"min_steps": "split_min_steps", "target": "split_blocks_per_sm", "warps": "split_warps",
             "cluster": "cluster", "bulk": "bulk_stages"}
    # SPLIT_MIN_STEPS, the planner's warps, cluster and ring unless given
    fields: dict[str, Any] = {"split_min_steps": None, "split_warps": None, "cluster": None,
                              "bulk_stages": None}
    for tok in var.split():
        k, _, v = tok.partition("=")
        if k not in knobs:
            raise SystemExit(f"unknown variant knob {tok!r}; use {sorted(knobs)}")
        fields[knobs[k]] = int(v)
    set_overrides(replace(current(), **fields))


def best_variant(sweep: list[dict[str, Any]]) -> str:
    """The sweep's variant|target with the lowest geometric-mean time (correct everywhere)."""
    keys = [k for k in sweep[0] if k != "point" and "|BAD_ERR" not in k]
    bad = {k.rsplit("|", 1)[0] for r in sweep for k in r if k.endswith("|BAD_ERR")}
    scores = {}
    for k in keys:
        if k in bad or any(k not in r for r in sweep):
            continue
        scores[k] = statistics.geometric_mean([r[k] for r in sweep])
    best = min(scores, key=scores.__getitem__)
    print(
        "sweep geomean us: "
        + ", ".join(f"{k}={v:.2f}" for k, v in sorted(scores.items(), key=lambda x: x[1]))
    )
    var, tgt = best.rsplit("|", 1)
    return ("" if var == "default" else var) + f" target={tgt}"
