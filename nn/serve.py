"""``python -m deviceops.nn.serve``: the OpenAI-compatible HTTP server.

The entry module; the command (flags, loading, uvicorn) is :mod:`deviceops.nn.serving.cli`.
"""

from __future__ import annotations

import sys

from .serving.cli import load_engine, load_engines, main, parse_devices

__all__ = ["load_engine", "load_engines", "main", "parse_devices"]

if __name__ == "__main__":
    sys.exit(main())
