"""Services the core calls but does not implement, filled in by the layers above it.

The core (streams, tensors, launch, ``DeviceOp``) sits below scheduling, the async bridge
and graphs, yet ``op.sync()`` needs the current policy, ``await op`` the async bridge and
``op.graph()`` the capture machinery. Rather than importing those layers, the core calls
the hooks below; each layer installs its implementation when it is imported
(``deviceops/__init__`` imports them all, so a user never sees an empty hook):

| hook              | installed by                         | called by                          |
|-------------------|--------------------------------------|------------------------------------|
| ``current_policy``| ``deviceops.scheduling._policy``     | ``sync``, ``schedule``, contexts   |
| ``await_op``      | ``deviceops._async``                 | ``DeviceOp.__await__``             |
| ``await_future``  | ``deviceops._async``                 | ``DeviceFuture.__await__``         |
| ``capture``       | ``deviceops.graphs._graph``          | ``DeviceOp.graph`` / ``graph_on``  |
| ``to_host``       | ``deviceops.api``                    | ``Tensor.to_host``                 |
| ``auto_graph``    | ``deviceops.graphs._auto``           | top-level execution under a policy |
|                   |                                      | with ``auto_graph`` (a tenant)     |

An uninstalled hook raises ``RuntimeError`` naming the module to import.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["MISS", "auto_graph", "await_future", "await_op", "capture", "current_policy", "install",
           "to_host"]

#: what ``auto_graph`` returns when it did not run the op (the caller executes it)
MISS: Any = object()


def _missing(hook: str, module: str) -> Callable[..., Any]:
    def call(*_: Any, **__: Any) -> Any:
        raise RuntimeError(f"deviceops: {hook} is provided by {module}, which is not imported; "
                           f"import deviceops (or {module}) first")

    return call


current_policy: Callable[[], Any] = _missing("current_policy", "deviceops.scheduling")
await_op: Callable[[Any], Any] = _missing("await_op", "deviceops._async")
await_future: Callable[[Any], Any] = _missing("await_future", "deviceops._async")
capture: Callable[[Any, Any], Any] = _missing("capture", "deviceops.graphs")
to_host: Callable[[Any], Any] = _missing("to_host", "deviceops.api")


def _no_auto_graph(op: Any, ctx: Any) -> Any:
    return MISS


auto_graph: Callable[[Any, Any], Any] = _no_auto_graph

_NAMES = frozenset(__all__) - {"install", "MISS"}


def install(**hooks: Callable[..., Any]) -> None:
    """Install implementations (``install(current_policy=fn)``); unknown names raise."""
    for name, fn in hooks.items():
        if name not in _NAMES:
            raise ValueError(f"deviceops._hooks.install: unknown hook {name!r}; known: "
                             f"{sorted(_NAMES)}")
        globals()[name] = fn
