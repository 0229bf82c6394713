"""The correctness record of ``benchmarks/multi_gpu.py``: :class:`Checks` keeps every
comparison the sections make, passed or not, and sums them up for the JSON record (a failure
there makes the script exit 1)."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

from _common import check


# -- correctness record ------------------------------------------------------------------
@dataclass
class Checks:
    """Every comparison made, passed or not (``_common``'s summary cannot fail)."""

    records: list[dict[str, Any]] = field(default_factory=list)

    def add(self, what: str, ok: bool, **detail: Any) -> bool:
        ok = bool(ok)
        self.records.append({"what": what, "passed": ok, **detail})
        if ok:
            check(True, what)  # counted in _common's list too
        elif len(self.failed) <= 10:
            extra = ", ".join(f"{k}={v}" for k, v in detail.items())
            print(f"CHECK FAILED: {what}" + (f" ({extra})" if extra else ""), file=sys.stderr, flush=True)
        return ok

    @property
    def failed(self) -> list[dict[str, Any]]:
        return [r for r in self.records if not r["passed"]]

    def summary(self, keep: int = 50) -> dict[str, Any]:
        distinct = list(dict.fromkeys(r["what"] for r in self.records))
        failed = self.failed
        first_failed = list({r["what"]: r for r in reversed(failed)}.values())[::-1]  # one of each
        return {"passed": bool(self.records) and not failed, "count": len(self.records),
                "distinct": len(distinct), "first": distinct[:keep],
                "failed": first_failed[:keep], "failed_count": len(failed)}
