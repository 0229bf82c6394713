"""Scheduling policies: which stream each op runs on.

See :mod:`deviceops.scheduling._policy` for how the current policy is chosen
and :mod:`deviceops.scheduling._policies` for the shipped policies.
"""

from __future__ import annotations

from ._policies import MultiDeviceRoundRobin, SingleStream, StreamPoolRoundRobin
from ._policy import SchedulingPolicy, current_policy, set_default_policy, using
from ._tenants import PRIORITIES, Tenant, TenantPool, priority_level

__all__ = [
    "PRIORITIES",
    "MultiDeviceRoundRobin",
    "SchedulingPolicy",
    "SingleStream",
    "StreamPoolRoundRobin",
    "Tenant",
    "TenantPool",
    "current_policy",
    "priority_level",
    "set_default_policy",
    "using",
]
