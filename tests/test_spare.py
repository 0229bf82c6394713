"""Spare arrays (deviceops/_storage.py): a dead storage's array is kept for reuse on its
stream only when nothing else references it. The rule is pure reference counting, tested
here with stand-ins (cpu, CI); tests/test_alloc_gpu.py checks it on CuPy arrays."""

from __future__ import annotations

from typing import Any

from deviceops import _storage as T


class _Stream:
    def __init__(self) -> None:
        self.spare: dict[Any, list[Any]] = {}


class _Array:
    def __init__(self) -> None:
        self.data = object()


class _Holder:  # stands for the dying Storage: holds the array as an attribute
    def __init__(self, base: Any) -> None:
        self.base = base

    def die(self, s: _Stream, key: Any) -> None:
        T._spare(s, key, self.base)  # type: ignore[arg-type]


KEY = ((3,), 1)


def test_an_unreferenced_array_is_kept() -> None:
    s = _Stream()
    _Holder(_Array()).die(s, KEY)
    assert len(s.spare[KEY]) == 1


def test_an_array_the_user_still_holds_is_not_kept() -> None:
    s, a = _Stream(), _Array()
    _Holder(a).die(s, KEY)
    assert KEY not in s.spare


def test_an_array_whose_memory_pointer_is_held_is_not_kept() -> None:
    s, a = _Stream(), _Array()
    mp = a.data
    h = _Holder(a)
    del a
    h.die(s, KEY)
    assert KEY not in s.spare and mp is not None


def test_bounded_per_key_and_in_keys() -> None:
    s = _Stream()
    for _ in range(T._SPARE_PER_KEY + 3):
        _Holder(_Array()).die(s, KEY)
    assert len(s.spare[KEY]) == T._SPARE_PER_KEY
    for i in range(T._SPARE_KEYS + 5):
        _Holder(_Array()).die(s, ((i + 10,), 1))
    assert len(s.spare) == T._SPARE_KEYS
