"""``python -m deviceops.precompile``: compile the common kernels for this machine's GPU now.

The first launch of a kernel variant compiles it with NVRTC (1-6 s each) unless CuPy's
on-disk kernel cache holds it; this command fills the cache for the GPU it runs on, in
parallel worker processes (``scripts/demo.sh`` runs it on a GPU machine). What it runs, its
flags and its output: :mod:`deviceops.nn._precompile` (the workload uses the kernels and the
model, which sit above this package's core). ``--help`` lists the flags with their defaults.
"""

from __future__ import annotations

import sys

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Run the precompile command (see :func:`deviceops.nn._precompile.main`)."""
    from deviceops.nn._precompile import main as run

    return run(argv)


if __name__ == "__main__":
    sys.exit(main())
