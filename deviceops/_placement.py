"""Placement: the device an op's input tensors live on.

A placing policy (:class:`~deviceops.scheduling.MultiDeviceRoundRobin`) runs an op on the
device of its data. :func:`placement` walks the op's DAG (iteratively: arguments nested
100,000 deep do not recurse) and collects the devices of the tensors it was given:

| op                                   | contributes                                      |
|--------------------------------------|--------------------------------------------------|
| kernel launch, ``api`` op            | its Tensor / Partition arguments (``_inputs``)   |
| ``api.to_device(t, d)``              | ``d``, and nothing below it (``_pin``)           |
| ``deviceops.value(tensor)``          | the tensor                                       |
| ``zip`` of branches on one device    | that device; of several devices: nothing (each   |
|                                      | branch is placed on its own when the zip runs)   |
| ``then`` / ``map`` / ``shared`` ...  | what the op they wrap contributes                |

Tensors on two devices are refused before anything is enqueued, with a
:class:`~deviceops.DeviceError` naming the op, both devices and ``api.to_device``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._errors import DeviceError

if TYPE_CHECKING:
    from ._device import Device
    from ._op import DeviceOp

__all__ = ["placement"]


def placement(root: DeviceOp[Any]) -> Device | None:
    """The one device the input tensors of ``root``'s DAG live on; ``None`` if it has none.

    Raises:
        DeviceError: the inputs live on two devices; the message names both, the ops that
            hold them, and ``api.to_device``.
    """
    found: dict[Device, str] = {}
    seen: set[int] = set()
    stack: list[DeviceOp[Any]] = [root]
    while stack:
        op = stack.pop()
        if id(op) in seen:
            continue
        seen.add(id(op))
        pinned, stop = op._pin()
        if pinned is not None:
            found.setdefault(pinned, op._describe())
        if stop:
            continue
        for t in op._inputs():
            found.setdefault(t.device, op._describe())
        stack.extend(op._children())
        if len(found) > 1:
            break
    if len(found) > 1:
        (d0, w0), (d1, w1) = list(found.items())[:2]
        raise DeviceError(
            f"{root._describe()}: its input tensors live on two devices, {d0} (an argument of "
            f"{w0}) and {d1} (an argument of {w1}); an op runs on one device. Copy the data "
            f"first with api.to_device(t, {str(d0)!r}) (or to {str(d1)!r}).",
            op=root._describe(), device=str(d1))
    return next(iter(found), None)
