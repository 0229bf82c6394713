"""The per-row decode state of a :class:`~.runner.Runner`, on the device and its host shadow.

Device memory, one column per cache row: ``state`` ``(4, max_batch)`` int32 with the rows
``start`` (the position the next input token is written at), ``kv_len`` (valid keys after
that write), ``inc`` (1 for an active row, 0 for an idle one: what a decode step adds to
``start``/``kv_len``) and ``tokens`` (the input token; a decode step samples the next one
into it); the sampling parameters ``temperature``, ``top_k``, ``top_p``, ``seed`` and the
random ``counter`` (draw ``n`` of a row uses ``(seed, n)``).

The host keeps a shadow (``h_state``, ``h_counter``, ``h_sampling``) and uploads it only when
a decode step's rows do not simply continue from the previous step (``cont``), or after
something else touched the device state (``dirty``). An idle row's position is ``idle``:
past every block table, so its writes are skipped.
"""

from __future__ import annotations

import numpy as np

from deviceops import Stream, api

__all__ = ["RowState"]


class RowState:
    """Device and host state of ``max_batch`` cache rows (module docstring).

    Args:
        stream: the runner's stream (allocation and uploads).
        max_batch: rows.
        idle: the position of an idle row (``max_blocks * block_size``).
    """

    def __init__(self, stream: Stream, max_batch: int, idle: int) -> None:
        n = max_batch
        self.stream = stream
        self.idle = idle
        self.state = api.zeros((4, n), "int32").sync_on(stream)
        self.start, self.kv_len, self.inc, self.tokens = (self.state[i] for i in range(4))
        self.temperature = api.zeros((n,), "float32").sync_on(stream)
        self.top_k = api.zeros((n,), "int32").sync_on(stream)
        self.top_p = api.ones((n,), "float32").sync_on(stream)
        self.seed = api.zeros((n,), "int64").sync_on(stream)
        self.counter = api.zeros((n,), "int64").sync_on(stream)
        self.h_sampling = [(0.0, 0, 1.0, 0)] * n  # temperature, top_k, top_p, seed
        self.h_state = np.zeros((4, n), np.int32)
        self.h_state[0] = idle  # inactive: writes skipped
        self.h_state[1] = 1
        self.h_counter = np.zeros((n,), np.int64)
        self.cont = np.zeros((n,), bool)  # row continues from the last decode step
        self.dirty = True

    def set_sampling(self, slot: int, temperature: float, top_k: int, top_p: float,
                     seed: int) -> None:
        """Upload row ``slot``'s sampling parameters and reset its counter (checked values)."""
        r = slice(slot, slot + 1)
        for dst, val, dt in ((self.temperature, temperature, np.float32),
                             (self.top_k, top_k, np.int32), (self.top_p, top_p, np.float32),
                             (self.seed, seed, np.int64), (self.counter, 0, np.int64)):
            api.memcpy(dst[r], api.from_host(np.array([val], dt))).async_on(self.stream)
        self.h_sampling[slot] = (temperature, top_k, top_p, seed)
        self.h_counter[slot] = 0
        self.cont[slot] = False

    def idle_state(self, b: int) -> np.ndarray:
        """The shadow with rows ``0 .. b-1`` idle (what a warm-up step runs over)."""
        idle = self.h_state.copy()
        idle[0, :b], idle[1, :b], idle[2, :b] = self.idle, 1, 0
        idle[3, :b][idle[3, :b] < 0] = 0
        return idle

    def upload_state(self, state: np.ndarray) -> None:
        """Copy ``state`` ``(4, max_batch)`` to the device rows (not the shadow)."""
        api.memcpy(self.state, api.from_host(state)).async_on(self.stream)

    def upload_counters(self) -> None:
        """Copy the host counters to the device."""
        api.memcpy(self.counter, api.from_host(self.h_counter)).async_on(self.stream)
