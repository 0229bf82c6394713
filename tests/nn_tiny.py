"""A tiny random Llama written as a GGUF file, and a float64 NumPy reference forward.

Used by the ``tests/test_nn_*.py`` files: the loader, tokenizer, model, generation and
sampling tests run on it in seconds on the cpu backend.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

VOCAB_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("Ġ", "a"), ("i", "n"), ("o", "n")]
TEMPLATE = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
            "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
DIMS = {"hidden": 64, "heads": 4, "kv_heads": 2, "ffn": 96, "layers": 2, "ctx": 256,
        "theta": 10000.0, "eps": 1e-5}


def vocab() -> tuple[list[str], list[int]]:
    from tokenizers import pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    toks = [*VOCAB_SPECIAL, *alphabet, *(a + b for a, b in MERGES)]
    types = [3] * len(VOCAB_SPECIAL) + [1] * (len(toks) - len(VOCAB_SPECIAL))
    return toks, types


def hf_weights(seed: int = 0, *, tied: bool = True) -> dict[str, np.ndarray]:
    """Random float32 weights under Hugging Face names (q/k in rotate-half order)."""
    rng = np.random.default_rng(seed)
    v = len(vocab()[0])
    h, f, nh, nkv = DIMS["hidden"], DIMS["ffn"], DIMS["heads"], DIMS["kv_heads"]
    d = h // nh

    def m(r: int, c: int, scale: float) -> np.ndarray:
        return (rng.standard_normal((r, c)) * scale).astype(np.float32)

    w = {"model.embed_tokens.weight": m(v, h, 1.0),
         "model.norm.weight": (1 + 0.1 * rng.standard_normal(h)).astype(np.float32)}
    for i in range(DIMS["layers"]):
        p = f"model.layers.{i}."
        w |= {p + "self_attn.q_proj.weight": m(nh * d, h, h ** -0.5),
              p + "self_attn.k_proj.weight": m(nkv * d, h, h ** -0.5),
              p + "self_attn.v_proj.weight": m(nkv * d, h, h ** -0.5),
              p + "self_attn.o_proj.weight": m(h, nh * d, (nh * d) ** -0.5),
              p + "mlp.gate_proj.weight": m(f, h, h ** -0.5),
              p + "mlp.up_proj.weight": m(f, h, h ** -0.5),
              p + "mlp.down_proj.weight": m(h, f, f ** -0.5),
              p + "input_layernorm.weight": (1 + 0.1 * rng.standard_normal(h)).astype(np.float32),
              p + "post_attention_layernorm.weight": (1 + 0.1 * rng.standard_normal(h)).astype(np.float32)}
    if not tied:
        w["lm_head.weight"] = m(v, h, 1.0)
    return w


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row order (what convert_hf_to_gguf.py writes)."""
    r, c = w.shape
    return np.ascontiguousarray(w.reshape(n_head, 2, r // n_head // 2, c).swapaxes(1, 2).reshape(r, c))


_GG = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
       "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
       "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
       "post_attention_layernorm": "ffn_norm"}


def gguf_name(hf: str) -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    parts = hf.split(".")  # model.layers.i.<a>.<b>.weight (or .bias)
    return f"blk.{parts[2]}.{_GG['.'.join(parts[3:-1])]}.{parts[-1]}"


def write_gguf(path: Path, w: dict[str, np.ndarray], qtype: str = "F32", *, arch: str = "llama",
               ffn: int | None = None, bad_tensor: str | None = None, permute: bool = True,
               pre: str = "smollm", bos: int = 1, template: str = TEMPLATE,
               qtypes: dict[str, str] | None = None) -> dict[str, np.ndarray]:
    """Write ``w`` as a GGUF file; 2-D weights stored as ``qtype``. Returns the weights the file
    holds, dequantized (what a correct loader must give).

    ``permute``: q/k rows in llama.cpp's Llama order (``False``: as given, as llama.cpp stores
    Qwen2's); ``pre``: ``tokenizer.ggml.pre``; ``bos``: the BOS (and padding) id; ``template``:
    the chat template. Biases (``...q_proj.bias``) are stored as ``blk.{i}.attn_q.bias``.
    ``qtypes``: the type of some 2-D weights by GGUF name without the block prefix
    (``{"attn_v.weight": "Q8_0", "token_embd.weight": "Q8_0"}``), others ``qtype``."""
    import gguf

    wr = gguf.GGUFWriter(str(path), arch)
    toks, types = vocab()
    wr.add_block_count(DIMS["layers"])
    wr.add_context_length(DIMS["ctx"])
    wr.add_embedding_length(DIMS["hidden"])
    wr.add_feed_forward_length(ffn or DIMS["ffn"])
    wr.add_head_count(DIMS["heads"])
    wr.add_head_count_kv(DIMS["kv_heads"])
    wr.add_rope_freq_base(DIMS["theta"])
    wr.add_layer_norm_rms_eps(DIMS["eps"])
    wr.add_rope_dimension_count(DIMS["hidden"] // DIMS["heads"])
    wr.add_vocab_size(len(toks))
    wr.add_tokenizer_model("gpt2")
    wr.add_tokenizer_pre(pre)
    wr.add_token_list(toks)
    wr.add_token_types(types)
    wr.add_token_merges([f"{a} {b}" for a, b in MERGES])
    wr.add_bos_token_id(bos)
    wr.add_pad_token_id(bos)
    wr.add_eos_token_id(2)
    wr.add_add_bos_token(False)
    wr.add_chat_template(template)
    held: dict[str, np.ndarray] = {}
    for name, a in w.items():
        g = gguf_name(name)
        arr = a
        if permute and g.endswith("attn_q.weight"):
            arr = permute_qk(a, DIMS["heads"])
        elif permute and g.endswith("attn_k.weight"):
            arr = permute_qk(a, DIMS["kv_heads"])
        if bad_tensor == name:
            wr.add_tensor(g, arr.astype(np.int32))
            held[name] = a
            continue
        tq = (qtypes or {}).get(g.split(".", 2)[-1] if g.startswith("blk.") else g, qtype)
        if a.ndim == 2 and tq != qtype:
            qt = getattr(gguf.GGMLQuantizationType, tq)
        else:
            qt = getattr(gguf.GGMLQuantizationType, qtype)
        if a.ndim == 2 and tq != "F32":
            data = gguf.quants.quantize(arr, qt)
            wr.add_tensor(g, data, raw_dtype=qt)
            deq = gguf.quants.dequantize(data, qt).reshape(arr.shape).astype(np.float32)
        else:
            wr.add_tensor(g, arr)
            deq = arr
        if permute and g.endswith("attn_q.weight"):
            deq = _unpermute(deq, DIMS["heads"])
        elif permute and g.endswith("attn_k.weight"):
            deq = _unpermute(deq, DIMS["kv_heads"])
        held[name] = np.asarray(deq, np.float32)
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    return held


def _unpermute(w: np.ndarray, n: int) -> np.ndarray:
    r, c = w.shape
    return w.reshape(n, r // n // 2, 2, c).swapaxes(1, 2).reshape(r, c)


def _rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _rope(x: np.ndarray, pos: np.ndarray, theta: float) -> np.ndarray:
    d = x.shape[-1]
    a = pos[:, None] * theta ** (-2.0 * np.arange(d // 2) / d)  # (L, D/2)
    c, s = np.cos(a)[:, None], np.sin(a)[:, None]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], -1)


def reference_logits(w: dict[str, Any], ids: list[int],
                     dims: dict[str, Any] | None = None) -> np.ndarray:
    """float64 Llama forward of ``ids`` (positions 0..L-1): logits ``(L, V)``.

    ``dims``: ``heads``, ``kv_heads``, ``eps``, ``theta``, ``layers`` (default :data:`DIMS`).
    A q/k/v projection bias in ``w`` (``...q_proj.bias``) is added."""
    dims = DIMS if dims is None else dims
    w = {k: np.asarray(v, np.float64) for k, v in w.items()}
    nh, nkv, eps, th = dims["heads"], dims["kv_heads"], dims["eps"], dims["theta"]
    e = w["model.embed_tokens.weight"]
    d = e.shape[1] // nh
    x = e[np.asarray(ids)]
    n = len(ids)
    pos = np.arange(n, dtype=np.float64)
    mask = np.triu(np.full((n, n), -np.inf), 1)
    for i in range(dims["layers"]):
        p = f"model.layers.{i}."
        h = _rms(x, w[p + "input_layernorm.weight"], eps)
        q = (h @ w[p + "self_attn.q_proj.weight"].T + w.get(p + "self_attn.q_proj.bias", 0.0))
        k = (h @ w[p + "self_attn.k_proj.weight"].T + w.get(p + "self_attn.k_proj.bias", 0.0))
        v = (h @ w[p + "self_attn.v_proj.weight"].T + w.get(p + "self_attn.v_proj.bias", 0.0))
        q, k, v = q.reshape(n, nh, d), k.reshape(n, nkv, d), v.reshape(n, nkv, d)
        q, k = _rope(q, pos, th), _rope(k, pos, th)
        out = np.empty((n, nh, d))
        for hh in range(nh):
            kv = hh // (nh // nkv)
            sc = q[:, hh] @ k[:, kv].T / np.sqrt(d) + mask
            pr = np.exp(sc - sc.max(-1, keepdims=True))
            pr /= pr.sum(-1, keepdims=True)
            out[:, hh] = pr @ v[:, kv]
        x = x + out.reshape(n, nh * d) @ w[p + "self_attn.o_proj.weight"].T
        h = _rms(x, w[p + "post_attention_layernorm.weight"], eps)
        g = h @ w[p + "mlp.gate_proj.weight"].T
        u = h @ w[p + "mlp.up_proj.weight"].T
        x = x + (g / (1 + np.exp(-g)) * u) @ w[p + "mlp.down_proj.weight"].T
    x = _rms(x, w["model.norm.weight"], eps)
    head = w.get("lm_head.weight", e)
    return np.asarray(x @ head.T)


def reference_greedy(held: dict[str, np.ndarray], ids: list[int], n: int,
                     dims: dict[str, Any] | None = None) -> list[int]:
    """``n`` greedy tokens after ``ids`` from the float64 reference (:func:`reference_logits`)."""
    seq, out = list(ids), []
    for _ in range(n):
        tok = int(np.argmax(reference_logits(held, seq, dims)[-1]))
        out.append(tok)
        seq.append(tok)
    return out
