"""OpenAI's ``logit_bias``, ``presence_penalty``/``frequency_penalty`` and ``logprobs`` have
their effect, end to end, on the tiny random Llama (``tests/nn_tiny.py``) on the cpu backend:
through the runner, the engine, HTTP (streamed and not) and the official ``openai`` client.

Every expectation is recomputed in NumPy from the model's own prefill logits
(``CausalLM.logits``) of the prompt plus the tokens generated so far: the penalised logits
``x + bias - (presence * (count > 0) + frequency * count)`` over the generated tokens, their
argmax (greedy) and their log-softmax (within 1e-4), and the top-k sorted. Each test first
checks that the alternatives it tells apart differ (a huge negative bias changes the greedy
output, the plain greedy output repeats a token the penalties then avoid).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anyio
import httpx
import numpy as np
import pytest

from deviceops import nn
from deviceops.nn.serving.engine import Engine

from . import nn_tiny
from .test_serve_http import ServerThread, sse_events

pytestmark = [pytest.mark.timeout(120)]

IDS = [5, 17, 30, 40, 22]
N = 7
#: Bans the special tokens (EOS among them: an EOS token gets no logprobs entry).
NO_SPECIALS = {"0": -100, "1": -100, "2": -100}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Any:
    path = tmp_path_factory.mktemp("tiny") / "tiny.gguf"
    nn_tiny.write_gguf(path, nn_tiny.hf_weights(2, tied=False), "F32")
    return nn.load_gguf(path, device="cpu", dtype="float32", max_batch=4, max_seq=48,
                        prefill_chunk=32)


def _logits(m: Any, ids: list[int]) -> np.ndarray:
    """The model's float32 logits after ``ids`` (its last prefill row), as float64."""
    out = m.logits(ids).sync_on(m.device_stream)
    return np.asarray(out.to_host().sync_on(m.device_stream)[-1], np.float64)


def _adjusted(m: Any, prompt: list[int], out: list[int], presence: float = 0.0,
              frequency: float = 0.0, bias: dict[int, float] | None = None) -> np.ndarray:
    x = _logits(m, prompt + out)
    counts = np.bincount(np.asarray(out, np.int64), minlength=x.shape[0]).astype(np.float64)
    for t, b in (bias or {}).items():
        x[t] += b
    return x - np.where(counts > 0, presence + frequency * counts, 0.0)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    m = x.max()
    return x - m - np.log(np.exp(x - m).sum())


def _greedy_reference(m: Any, prompt: list[int], n: int, **adj: Any) -> list[int]:
    out: list[int] = []
    for _ in range(n):
        out.append(int(np.argmax(_adjusted(m, prompt, out, **adj))))
    return out


async def _run(eng: Engine, prompt: list[int], n: int = N, **kw: Any) -> tuple[list[int], Any]:
    s = eng.stream(prompt, n, ignore_eos=True, **kw)
    with anyio.fail_after(60):
        toks = [t async for t in s]
    return toks, s.logprobs


@pytest.mark.anyio
@pytest.mark.parametrize("graph", [True, False], ids=["graph", "eager"])
async def test_logit_bias_changes_and_forces_tokens(model: Any, graph: bool) -> None:
    m = model
    m.runner.decoder.graphs.clear()  # the variant under test captures its own
    m.runner.decoder.feature_graphs.clear()
    eng = Engine(m, max_batch=4, max_seq=48)
    if not graph:
        eng.steps._decode = lambda s, t, p: m.decode_step(s, t, p, graph=False)  # type: ignore[attr-defined]
    plain, _ = await _run(eng, IDS)
    assert plain == _greedy_reference(m, IDS, N)
    ban = {plain[0]: -100.0}
    banned, _ = await _run(eng, IDS, logit_bias=ban)
    assert banned[0] != plain[0] and plain[0] not in banned
    assert banned == _greedy_reference(m, IDS, N, bias=ban)
    forced, _ = await _run(eng, IDS, logit_bias={77: 100.0})
    assert forced == [77] * N
    # rows with and without a bias share the batch: each gets its own
    (a, _), (b, _) = await _both(eng, {"logit_bias": ban}, {})
    assert a == banned and b == plain
    assert eng.stats().slots_in_use == 0


async def _both(eng: Engine, kw1: dict[str, Any], kw2: dict[str, Any]) -> list[Any]:
    res: list[Any] = [None, None]
    async with anyio.create_task_group() as tg:
        async def one(i: int, kw: dict[str, Any]) -> None:
            res[i] = await _run(eng, IDS, **kw)

        tg.start_soon(one, 0, kw1)
        tg.start_soon(one, 1, kw2)
    return res


@pytest.mark.anyio
async def test_presence_and_frequency_penalties_stop_a_repeated_token(model: Any) -> None:
    eng = Engine(model, max_batch=4, max_seq=48)
    plain, _ = await _run(eng, IDS, 10)
    assert len(set(plain)) < len(plain)  # greedy repeats a token
    for adj in ({"presence": 2.0}, {"frequency": 2.0}, {"presence": 1.5, "frequency": 0.5}):
        kw = {"presence_penalty": adj.get("presence", 0.0),
              "frequency_penalty": adj.get("frequency", 0.0)}
        got, _ = await _run(eng, IDS, 10, **kw)
        assert got == _greedy_reference(model, IDS, 10, **adj), adj
        assert got != plain
    strong, _ = await _run(eng, IDS, 10, presence_penalty=2.0, frequency_penalty=2.0)
    assert len(set(strong)) == len(strong)  # no token twice
    # negative penalties encourage repeats
    rep, _ = await _run(eng, IDS, 10, presence_penalty=-2.0, frequency_penalty=-2.0)
    assert rep == _greedy_reference(model, IDS, 10, presence=-2.0, frequency=-2.0)
    assert len(set(rep)) < len(set(plain))


@pytest.mark.anyio
async def test_logprobs_are_the_log_softmax_of_the_adjusted_logits(model: Any) -> None:
    eng = Engine(model, max_batch=4, max_seq=48)
    kw: dict[str, Any] = {"presence_penalty": 0.7, "frequency_penalty": 0.4,
                          "logit_bias": {9: 3.0, 145: -2.0}}
    for temperature in (0.0, 1.3):
        toks, lps = await _run(eng, IDS, logprobs=5, temperature=temperature, seed=3, **kw)
        assert len(lps) == len(toks)
        for i, (t, lp) in enumerate(zip(toks, lps, strict=True)):
            want = _log_softmax(_adjusted(model, IDS, toks[:i], 0.7, 0.4, {9: 3.0, 145: -2.0}))
            assert lp.token == t
            assert abs(lp.logprob - want[t]) < 1e-4
            order = np.lexsort((np.arange(want.size), -want))[:5]
            assert [x[0] for x in lp.top] == order.tolist()
            np.testing.assert_allclose([x[1] for x in lp.top], want[order], atol=1e-4)
    toks, lps = await _run(eng, IDS, logprobs=0)
    assert all(lp.top == () for lp in lps)
    _, none = await _run(eng, IDS)
    assert none == []


@pytest.mark.anyio
async def test_engine_refuses_bad_values_and_features_a_model_lacks(model: Any) -> None:
    from .test_engine import Toy

    eng = Engine(model, max_batch=4, max_seq=48)
    for kw, word in (({"presence_penalty": 2.5}, "presence_penalty"),
                     ({"logit_bias": {10**6: 1.0}}, "logit_bias"),
                     ({"logit_bias": {3: 101}}, "logit_bias"), ({"logprobs": 21}, "logprobs")):
        with pytest.raises(ValueError, match=word):
            eng.stream(IDS, 2, **kw)
    toy = Engine(Toy(), max_batch=2, max_seq=32)
    with pytest.raises(ValueError, match="logprobs"):
        toy.stream([1, 2], 2, logprobs=1)
    toy.stream([1, 2], 2, presence_penalty=0.0, logit_bias={}).cancel()  # neutral: accepted


# -- HTTP and the openai client ----------------------------------------------------------------

@pytest.fixture(scope="module")
def server(model: Any) -> Iterator[ServerThread]:
    from deviceops.nn.serving.http import create_app

    app = create_app(lambda: Engine(model, max_batch=4, max_seq=48), model_name="tiny")
    with ServerThread(app) as srv:
        srv.wait_healthy()
        yield srv


def _check_completion_logprobs(model: Any, lp: dict[str, Any], prompt: list[int], n: int,
                               text: str) -> list[int]:
    """The completions ``logprobs`` object against NumPy; returns the tokens' ids."""
    toks: list[int] = []
    so_far = ""  # the detokenized text (held back while it ends inside a UTF-8 character)
    bias = {int(k): float(v) for k, v in NO_SPECIALS.items()}
    for i, (tok_text, tlp, top) in enumerate(zip(lp["tokens"], lp["token_logprobs"],
                                                 lp["top_logprobs"], strict=True)):
        want = _log_softmax(_adjusted(model, prompt, toks, bias=bias))
        t = int(np.argmax(want))  # greedy
        assert tok_text == model.decode([t])
        assert abs(tlp - want[t]) < 1e-4
        order = np.lexsort((np.arange(want.size), -want))[:n]
        top_want: dict[str, float] = {}
        for j in order:
            top_want.setdefault(model.decode([int(j)]), float(want[j]))
        assert list(top) == list(top_want)
        np.testing.assert_allclose(list(top.values()), list(top_want.values()), atol=1e-4)
        assert lp["text_offset"][i] == len(so_far)
        toks.append(t)
        full = model.decode(toks)
        if not full.endswith("\ufffd"):
            so_far = full
    assert so_far == text
    return toks


def test_http_completions_logprobs_streamed_and_not(server: ServerThread, model: Any) -> None:
    body = {"prompt": IDS, "max_tokens": 6, "temperature": 0, "logprobs": 3,
            "logit_bias": NO_SPECIALS}
    with httpx.Client(base_url=server.url, timeout=60) as c:
        r = c.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        ch = r.json()["choices"][0]
        toks = _check_completion_logprobs(model, ch["logprobs"], IDS, 3, ch["text"])
        assert len(toks) == 6
        with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            ev = sse_events(r.iter_lines())
        chunks = [e["choices"][0] for e in ev[:-1] if e.get("choices")]
        merged: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                        "text_offset": []}
        for chunk in chunks:
            if chunk["logprobs"] is not None:
                for key in merged:
                    merged[key] += chunk["logprobs"][key]
        assert merged == ch["logprobs"]
        # no logprobs asked: null, as before
        r = c.post("/v1/completions", json={"prompt": IDS, "max_tokens": 2})
        assert r.json()["choices"][0]["logprobs"] is None


def test_http_chat_logprobs_bias_and_penalties(server: ServerThread, model: Any) -> None:
    msgs = [{"role": "user", "content": "the tea"}]
    body = {"messages": msgs, "max_tokens": 5, "temperature": 0, "logprobs": True,
            "top_logprobs": 4, "logit_bias": NO_SPECIALS}
    with httpx.Client(base_url=server.url, timeout=60) as c:
        r = c.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        ch = r.json()["choices"][0]
        content = ch["logprobs"]["content"]
        assert len(content) == 5
        for x in content:
            tops = x["top_logprobs"]
            assert len(tops) == 4 and x["bytes"] == list(x["token"].encode())
            assert [t["logprob"] for t in tops] == sorted((t["logprob"] for t in tops),
                                                          reverse=True)
            assert tops[0]["token"] == x["token"] and tops[0]["logprob"] == x["logprob"]
            assert sum(np.exp(t["logprob"]) for t in tops) <= 1 + 1e-5
        # the same prompt again, computed in full as the first was: a prompt prefilled after
        # a cache hit (its tail over the cached blocks) may differ in the last bits
        server.engine.clear_prefix_cache()
        with c.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
            ev = sse_events(r.iter_lines())
        streamed = [x for e in ev[:-1] if e.get("choices")
                    for x in (e["choices"][0]["logprobs"] or {"content": []})["content"]]
        assert streamed == content
        # a bias forcing a token, and penalties, change the chat's text
        forced = c.post("/v1/chat/completions", json={
            "messages": msgs, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
            "logit_bias": {"77": 100}}).json()["choices"][0]["message"]["content"]
        assert forced == model.decode([77] * 4)
        plain = c.post("/v1/chat/completions", json={
            "messages": msgs, "max_tokens": 10, "temperature": 0, "ignore_eos": True}).json()
        pen = c.post("/v1/chat/completions", json={
            "messages": msgs, "max_tokens": 10, "temperature": 0, "ignore_eos": True,
            "presence_penalty": -2, "frequency_penalty": -2}).json()  # repeats: new text
        assert pen["choices"][0]["message"]["content"] != plain["choices"][0]["message"]["content"]


@pytest.mark.parametrize(("path", "extra", "param"), [
    ("/v1/completions", {"logit_bias": {"100000": 1}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"x": 1}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"5": 101}}, "logit_bias"),
    ("/v1/completions", {"logprobs": 21}, "logprobs"),
    ("/v1/completions", {"logprobs": True}, "logprobs"),
    ("/v1/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": 3}, "logprobs"),
    ("/v1/chat/completions", {"frequency_penalty": -2.5}, "frequency_penalty"),
])
def test_http_bad_feature_values_are_400(server: ServerThread, path: str, extra: dict[str, Any],
                                         param: str) -> None:
    body: dict[str, Any] = {"max_tokens": 2, **extra}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if "chat" in path
                else {"prompt": "hi"})
    r = httpx.post(server.url + path, json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_the_official_openai_client_gets_logprobs(server: ServerThread, model: Any) -> None:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    r = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
        temperature=0, logprobs=True, top_logprobs=2, logit_bias=NO_SPECIALS)
    content = r.choices[0].logprobs.content
    assert len(content) == 3 and all(len(x.top_logprobs) == 2 for x in content)
    assert all(x.top_logprobs[0].logprob == x.logprob for x in content)  # greedy: the top one
    c = client.completions.create(model="tiny", prompt=IDS, max_tokens=4, temperature=0,
                                  logprobs=2, logit_bias={"77": 100},
                                  extra_body={"ignore_eos": True})
    assert c.choices[0].text == model.decode([77] * 4)
    assert c.choices[0].logprobs.tokens == [model.decode([77])] * 4
    assert all(lp > -1e-3 for lp in c.choices[0].logprobs.token_logprobs)  # forced: p ~ 1
    tokens = [t for ch in client.completions.create(
        model="tiny", prompt=IDS, max_tokens=8, temperature=0, presence_penalty=-2.0,
        frequency_penalty=-1.0, logprobs=0, stream=True, extra_body={"ignore_eos": True})
        if ch.choices and ch.choices[0].logprobs for t in ch.choices[0].logprobs.tokens]
    want = _greedy_reference(model, IDS, 8, presence=-2.0, frequency=-1.0)
    assert want != _greedy_reference(model, IDS, 8)
    eos = set(model.config.stop_ids)  # no entry: their text is empty
    assert tokens == [model.decode([t]) for t in want if t not in eos]


# -- on the GPU (run by the lead: tools/gpu.sh) -------------------------------------------------

@pytest.mark.gpu
@pytest.mark.anyio
@pytest.mark.timeout(300)
@pytest.mark.parametrize("dtype", ["float32", "float16"])
async def test_features_on_cuda_graphs_match_numpy(dtype: str) -> None:
    """The CUDA path: decode graphs of both variants (rows with and without features in one
    batch), the prefill graph plus the eager feature draw, against NumPy over the GPU model's
    own logits; a plain row in the same batch equals ``generate``."""
    import deviceops
    from deviceops.nn import LlamaConfig, random_model

    if not deviceops.cuda_available():
        pytest.skip("needs a CUDA GPU")
    cfg = LlamaConfig(vocab_size=4099, hidden_size=256, intermediate_size=512, num_layers=4,
                      num_heads=4, num_kv_heads=2, head_dim=64, rope_theta=1e4)
    m = random_model(cfg, dtype=dtype, device=0, max_batch=4, max_seq=128, prefill_chunk=64)
    eng = Engine(m, max_batch=4, max_seq=128)  # captures the plain graphs
    prompt = list(range(3, 40))
    plain_want = m.generate(prompt, 8)
    adj = {"presence": 1.5, "frequency": 0.5, "bias": {11: 4.0}}
    kw = {"presence_penalty": 1.5, "frequency_penalty": 0.5, "logit_bias": {11: 4.0},
          "logprobs": 20}
    res: list[Any] = [None, None, None]
    async with anyio.create_task_group() as tg:
        async def one(i: int, k: dict[str, Any]) -> None:
            res[i] = await _run(eng, prompt, 8, **k)

        tg.start_soon(one, 0, kw)
        tg.start_soon(one, 1, {})
        tg.start_soon(one, 2, {"logit_bias": {4000: 100.0, 39: -100.0}})
    (toks, lps), (plain, _), (biased, _) = res
    tol = 1e-3 if dtype == "float32" else 3e-2
    # this random model's logits span ~150, so a bias of 100 need not force a token: each
    # drawn token is the greedy pick of the biased logits, recomputed in NumPy
    for i, t in enumerate(biased):
        want = _adjusted(m, prompt, biased[:i], bias={4000: 100.0, 39: -100.0})
        assert want[t] >= want.max() - tol * max(1.0, abs(want.max())), (i, t, want.argmax())
    if dtype == "float32":  # (float16: other GEMM shapes may flip a near tie)
        assert plain[:len(plain_want)] == plain_want  # generate stops at EOS
    assert m.runner.decoder.feature_graphs  # the feature variant ran as a graph
    # logits of this random model reach ~150: float16 holds them to 0.125, so the tolerance
    # is relative (and the float32 one covers the GEMMs' summation order)
    rtol = 1e-4 if dtype == "float32" else 4e-3
    for i, (t, lp) in enumerate(zip(toks, lps, strict=True)):
        want = _log_softmax(_adjusted(m, prompt, toks[:i], **adj))
        assert lp.token == t
        np.testing.assert_allclose(lp.logprob, want[t], rtol=rtol, atol=tol)
        assert want[t] >= want.max() - tol - rtol * abs(want).max()  # greedy, adjusted
        top = [x[1] for x in lp.top]
        assert len(top) == 20 and top == sorted(top, reverse=True)
        np.testing.assert_allclose(top, np.sort(want)[::-1][:20], rtol=rtol, atol=tol)
    assert eng.stats().slots_in_use == 0
