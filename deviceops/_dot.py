"""``op.to_dot()``: the DAG of a DeviceOp in Graphviz dot.

Each node is an op; an edge ``a -> b`` means ``b`` consumes ``a``'s output.
Executed ops are labelled with the stream they ran on and coloured by it, so
the stream assignment of zip branches is visible.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._op import DeviceOp

_COLORS = ("#8dd3c7", "#ffffb3", "#bebada", "#fb8072", "#80b1d3", "#fdb462", "#b3de69", "#fccde5")


def to_dot(root: DeviceOp[Any]) -> str:
    """Render ``root`` and everything it consumes as a dot digraph."""
    ids: dict[int, str] = {}
    lines = ["digraph deviceops {", "  rankdir=BT;", '  node [shape=box, style="rounded,filled", fillcolor=white];']
    streams: dict[int, int] = {}
    stack = [root]
    edges: list[tuple[int, str]] = []
    while stack:
        op = stack.pop()
        if id(op) in ids:
            continue
        name = ids[id(op)] = f"n{len(ids)}"
        label = op._describe().replace('"', "'")
        fill = "white"
        if op._ran_on:
            k = streams.setdefault(op._ran_on, len(streams))
            label += f"\\nstream {op._ran_on}"
            fill = _COLORS[k % len(_COLORS)]
        lines.append(f'  {name} [label="{label}", fillcolor="{fill}"];')
        for child in op._children():
            stack.append(child)
            edges.append((id(child), name))
    for child_id, parent in edges:
        lines.append(f"  {ids[child_id]} -> {parent};")
    lines.append("}")
    return "\n".join(lines)
