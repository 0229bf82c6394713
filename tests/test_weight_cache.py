"""The on-disk cache of converted GGUF weights (``deviceops.nn.weight_cache``,
``DEVICEOPS_WEIGHT_CACHE``): a hit gives the arrays a conversion gives without parsing the
file, a changed file or another conversion version is a miss, the knob turns it off, and a
damaged entry is rebuilt."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
import pytest

from deviceops import api

from . import nn_tiny


def _entries(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))


def _no_parse(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make parsing a GGUF file fail: a read that succeeds came from the cache."""
    import gguf

    def refuse(*a: object, **k: object) -> None:
        raise AssertionError("the GGUF file was parsed again: not a cache hit")

    monkeypatch.setattr(gguf, "GGUFReader", refuse)


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("DEVICEOPS_WEIGHT_CACHE", str(root))
    return root


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_hit_returns_the_converted_arrays(dtype: str, cache: Path, tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from deviceops.nn.checkpoint import read_gguf

    path = tmp_path / "m.gguf"
    nn_tiny.write_gguf(path, nn_tiny.hf_weights(5, tied=False), "Q4_1")
    first = read_gguf(path, progress=False, dtype=dtype)
    assert len(_entries(cache)) == 1
    with monkeypatch.context() as mp:
        mp.setenv("DEVICEOPS_WEIGHT_CACHE", "0")
        plain = read_gguf(path, progress=False, dtype=dtype)
    _no_parse(monkeypatch)
    hit = read_gguf(path, progress=False, dtype=dtype)
    assert hit.config == first.config == plain.config
    assert hit.tokenizer_meta == plain.tokenizer_meta and hit.chat_template == plain.chat_template
    assert sorted(hit.weights) == sorted(plain.weights)
    for name, a in plain.weights.items():
        assert hit.weights[name].dtype == a.dtype and str(a.dtype) == dtype, name
        np.testing.assert_array_equal(np.asarray(hit.weights[name]).view(np.uint8),
                                      a.view(np.uint8), err_msg=name)


def test_model_from_the_cache_gives_the_same_logits(cache: Path, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from deviceops import nn

    path = tmp_path / "m.gguf"
    nn_tiny.write_gguf(path, nn_tiny.hf_weights(6), "Q8_0")

    def logits() -> np.ndarray:
        m = nn.load_gguf(path, device="cpu", dtype="float16", max_batch=1, max_seq=32)
        ids = m.encode("the theme")
        return np.asarray(api.to_host(m.logits(ids).sync_on(m.device_stream))
                          .sync_on(m.device_stream))

    cold = logits()
    _no_parse(monkeypatch)
    np.testing.assert_array_equal(logits(), cold)


def test_changed_file_is_converted_again(cache: Path, tmp_path: Path) -> None:
    from deviceops.nn.checkpoint import read_gguf

    path = tmp_path / "m.gguf"
    nn_tiny.write_gguf(path, nn_tiny.hf_weights(7), "F32")
    read_gguf(path, progress=False)
    old = _entries(cache)
    w = nn_tiny.hf_weights(8)
    nn_tiny.write_gguf(path, w, "F32")  # same size, other bytes and time
    ck = read_gguf(path, progress=False)
    for name, a in w.items():
        np.testing.assert_array_equal(ck.weights[name], a, err_msg=name)
    new = _entries(cache)
    assert len(new) == 1 and new != old  # the stale entry of the same file was removed


def test_another_conversion_version_is_a_miss(cache: Path, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from deviceops.nn import models
    from deviceops.nn.checkpoint import read_gguf

    path = tmp_path / "m.gguf"
    nn_tiny.write_gguf(path, nn_tiny.hf_weights(9), "F32")
    read_gguf(path, progress=False)
    arch = type(models.get("llama"))
    monkeypatch.setattr(arch, "conversion_version", arch.conversion_version + 1)
    import gguf

    parsed: list[str] = []
    real = gguf.GGUFReader

    def counting(p: str) -> object:
        parsed.append(p)
        return real(p)

    monkeypatch.setattr(gguf, "GGUFReader", counting)
    read_gguf(path, progress=False)
    assert parsed == [str(path)]
    parsed.clear()
    read_gguf(path, progress=False)  # stored again under the new version: a hit
    assert parsed == []


@pytest.mark.parametrize("value", ["0", ""])
def test_knob_turns_the_cache_off(value: str, tmp_path: Path,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from deviceops.nn.checkpoint import read_gguf

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    path = tmp_path / "m.gguf"
    nn_tiny.write_gguf(path, nn_tiny.hf_weights(10), "F32")
    monkeypatch.setenv("DEVICEOPS_WEIGHT_CACHE", "1")
    read_gguf(path, progress=False)  # the default folder under $XDG_CACHE_HOME
    assert len(_entries(tmp_path / "xdg" / "deviceops" / "weights")) == 1
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg2"))
    monkeypatch.setenv("DEVICEOPS_WEIGHT_CACHE", value)
    read_gguf(path, progress=False)
    read_gguf(path, progress=False)
    assert not (tmp_path / "xdg2").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf", "xdg"]


@pytest.mark.parametrize("damage", ["truncate", "remove", "index"])
def test_damaged_entry_is_rebuilt(damage: str, cache: Path, tmp_path: Path,
                                  caplog: pytest.LogCaptureFixture) -> None:
    from deviceops.nn.checkpoint import read_gguf

    path = tmp_path / "m.gguf"
    w = nn_tiny.hf_weights(11)
    nn_tiny.write_gguf(path, w, "F32")
    read_gguf(path, progress=False)
    (entry,) = _entries(cache)
    victim = max(entry.glob("*.npy"), key=lambda f: f.stat().st_size)
    size = victim.stat().st_size
    if damage == "truncate":
        os.truncate(victim, size // 2)
    elif damage == "remove":
        victim.unlink()
    else:
        (entry / "index.json").write_text('{"format": 1, "dty')
    with caplog.at_level(logging.WARNING, logger="deviceops.nn"):
        ck = read_gguf(path, progress=False)
    assert any("damaged" in r.getMessage() for r in caplog.records), caplog.text
    for name, a in w.items():
        np.testing.assert_array_equal(ck.weights[name], a, err_msg=name)
    assert _entries(cache) == [entry] and victim.stat().st_size == size  # rebuilt whole
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="deviceops.nn"):
        read_gguf(path, progress=False)
    assert not caplog.records


def test_unwritable_cache_says_what_to_do(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from deviceops.nn.checkpoint import read_gguf

    blocker = tmp_path / "not-a-folder"
    blocker.write_text("x")
    monkeypatch.setenv("DEVICEOPS_WEIGHT_CACHE", str(blocker / "cache"))
    path = tmp_path / "m.gguf"
    nn_tiny.write_gguf(path, nn_tiny.hf_weights(12), "F32")
    with pytest.raises(OSError, match="DEVICEOPS_WEIGHT_CACHE"):
        read_gguf(path, progress=False)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cached_maps_are_used_in_place_on_the_cpu_backend(
        dtype: str, cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # a cache hit's read-only maps become the cpu tensors' memory (no copy) and the model
    # computes what the converted (copied) weights compute: nothing writes into its weights
    from deviceops import nn
    from deviceops.nn import model as nn_model

    monkeypatch.setattr(nn_model, "_ADOPT_BYTES", 0)  # every map, not only large ones
    path = tmp_path / "m.gguf"
    nn_tiny.write_gguf(path, nn_tiny.hf_weights(13, tied=False), "Q8_0")
    kw: dict[str, object] = {"device": "cpu", "dtype": dtype, "progress": False, "max_seq": 64}
    first = nn.load_gguf(path, **kw)  # converted, then stored
    hit = nn.load_gguf(path, **kw)
    # the embedding and the unfused matrices in place (fused QKV, gate/up and norms are new)
    assert not hit.weights.embed.table.array.flags.writeable
    assert sum(not t.array.flags.writeable for t in hit.weights.tensors) > 3
    assert all(t.array.flags.writeable for t in first.weights.tensors)
    ids = [1, 5, 9, 3, 7, 2]
    assert hit.generate(ids, 6) == first.generate(ids, 6)
    s = hit.device_stream
    got = np.asarray(api.to_host(hit.logits(ids).sync_on(s)).sync_on(s), np.float32)
    want = np.asarray(api.to_host(first.logits(ids).sync_on(first.device_stream))
                      .sync_on(first.device_stream), np.float32)
    np.testing.assert_array_equal(got, want)


def test_native_reads_keep_the_tensor_table(cache: Path, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    # weights="native": the entry holds the metadata and the tensor table only (dtype
    # "native", no arrays); a second read maps the file's tensors without parsing it
    from deviceops.nn.checkpoint import read_gguf
    from deviceops.nn.models.quantized import QuantArray

    path = tmp_path / "m.gguf"
    nn_tiny.write_gguf(path, nn_tiny.hf_weights(14, tied=False), "Q4_0",
                       qtypes={"attn_v.weight": "Q8_0", "token_embd.weight": "F16"})
    first = read_gguf(path, progress=False, weights="native")
    (entry,) = _entries(cache)
    assert not list(entry.glob("*.npy"))
    with monkeypatch.context() as mp:
        _no_parse(mp)
        hit = read_gguf(path, progress=False, weights="native")
    assert hit.config == first.config and hit.tokenizer_meta == first.tokenizer_meta
    assert sorted(hit.weights) == sorted(first.weights)
    kinds = set()
    for name, a in first.weights.items():
        b = hit.weights[name]
        assert type(a) is type(b), name
        if isinstance(a, QuantArray):
            kinds.add(a.fmt)
            assert (a.fmt, a.shape) == (b.fmt, b.shape), name
            np.testing.assert_array_equal(a.blocks, b.blocks, err_msg=name)
        else:
            kinds.add(str(a.dtype))
            np.testing.assert_array_equal(a, b, err_msg=name)
    assert {"Q4_0", "Q8_0", "float32"} <= kinds
    # a table that points past the file is logged and the file read again
    import json

    index = json.loads((entry / "index.json").read_text())
    index["extra"]["tensors"][0][3] = 1 << 40
    (entry / "index.json").write_text(json.dumps(index))
    again = read_gguf(path, progress=False, weights="native")
    assert sorted(again.weights) == sorted(first.weights)
    # the expanded entry of the same file is another entry, and both stay
    read_gguf(path, progress=False)
    assert len(_entries(cache)) == 2
    read_gguf(path, progress=False, weights="native")
    assert len(_entries(cache)) == 2
