"""Batch generation over Ray replicas: :func:`batch_generate` (``deviceops.nn.batch_generate``).

A list of prompts is spread over the replicas of a Ray cluster (:mod:`.ray_cluster`): each
replica keeps about ``1.5 * max_batch`` prompts in flight (its running batch full and a
few queued behind it), taking the next prompt of the list as one finishes, so a fast
replica takes more of them. The replicas send each result once, whole (no per-token
stream). Results come back in input order, with a tqdm progress bar.

**Failure.** A prompt whose replica dies (or fails) goes back to the head of the list and
another replica takes it; the dead replica takes prompts again once Ray has restarted it.
Only if every replica is gone for good does the call raise, naming each one's error.

Results equal ``CausalLM.generate`` of the same prompts: each prompt is generated alone
with the same sampling arguments and seed (a ``CausalLM`` batch also samples each row from
``seed`` with its own counter), so greedy and seeded sampling give the same tokens on any
replica. ``seed=None`` draws one seed for the whole call, as ``CausalLM.generate`` does.

Without ``ray`` the same driver runs the prompts on one local
:class:`~deviceops.nn.Engine` (continuous batching on this machine).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import secrets
from collections import deque
from collections.abc import Sequence
from typing import Any

import anyio

from .._args import check_max_new_tokens, check_sampling
from .ray_cluster import RayReplicas, ReplicaSpec, init_ray
from .requests import EngineClosed, EngineFailed, EngineOverloaded

__all__ = ["abatch_generate", "batch_generate"]

Prompt = str | Sequence[int]


def _run(coro_fn: Any) -> Any:
    """``asyncio.run`` here, or in a worker thread when this thread already runs a loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro_fn())
    with concurrent.futures.ThreadPoolExecutor(1) as ex:
        return ex.submit(lambda: asyncio.run(coro_fn())).result()


async def abatch_generate(prompts: Sequence[Prompt], max_new_tokens: int, engines: Sequence[Any],
                          *, progress: bool = True, window: int | None = None,
                          **sampling: Any) -> list[list[int]]:
    """Generate every prompt on ``engines`` (Engines or Ray replica proxies); in order.

    Args:
        prompts: texts or token-id lists.
        max_new_tokens: new tokens per prompt at most.
        engines: :class:`~deviceops.nn.Engine` or engine-core clients
            (:class:`~.core_client.CoreClient`, e.g. Ray replicas' :class:`~.ray_remote.RayCoreClient`).
        progress: show a tqdm bar.
        window: prompts in flight per engine (default ``max_batch + max_batch // 2``).
        **sampling: ``temperature``, ``top_k``, ``top_p``, ``seed``, ``stop``, ``ignore_eos``.

    Raises:
        RuntimeError: every engine failed for good before all prompts were done.
    """
    from tqdm.auto import tqdm

    from .core_client import CoreClient

    n = len(prompts)
    results: list[list[int] | None] = [None] * n
    todo = deque(range(n))
    inflight = 0
    errors: dict[int, str] = {}
    wake = [anyio.Event()]  # set when a prompt comes back or the last one in flight ends

    def poke() -> None:
        wake[0].set()
        wake[0] = anyio.Event()

    async def worker(k: int, eng: Any) -> None:
        nonlocal inflight
        while True:
            if not todo:
                if inflight == 0:
                    return
                await wake[0].wait()  # a failed prompt may come back
                continue
            if getattr(eng, "dead", None) is not None or (
                    eng.closed and getattr(eng, "failure", None) is None):
                errors[k] = str(getattr(eng, "dead", None) or "closed")
                return
            if eng.failure is not None:  # restarting: the others take the work meanwhile
                if not isinstance(eng, CoreClient):  # a core comes back; an Engine does not
                    errors[k] = str(eng.failure)
                    return
                await anyio.sleep(0.05)
                continue
            i = todo.popleft()
            inflight += 1
            try:
                s = eng.stream(prompts[i], max_new_tokens, **sampling)
                toks = [t async for t in s]
            except (EngineFailed, EngineClosed) as exc:
                todo.appendleft(i)
                errors[k] = str(exc)
                poke()
                continue
            except EngineOverloaded:
                todo.appendleft(i)
                poke()
                await anyio.sleep(0.01)
                continue
            finally:
                inflight -= 1
                if inflight == 0 and not todo:
                    poke()
            results[i] = toks
            bar.update(1)

    with tqdm(total=n, desc="batch_generate", unit="prompt", disable=not progress) as bar:
        async with anyio.create_task_group() as tg:
            for k, eng in enumerate(engines):
                w = window if window is not None else eng.max_batch + eng.max_batch // 2
                for _ in range(max(1, w)):
                    tg.start_soon(worker, k, eng)
    missing = [i for i, r in enumerate(results) if r is None]
    if missing:
        raise RuntimeError(
            f"batch_generate: {len(missing)} of {n} prompts were not generated: every "
            "replica failed for good (" + "; ".join(f"{k}: {e}" for k, e in errors.items())
            + ")")
    return [r for r in results if r is not None]


def batch_generate(prompts: Sequence[Prompt], max_new_tokens: int = 32, *,
                   model: str = "smollm2", ray: bool | str | RayReplicas = False,
                   replicas: int | None = None, device: str | None = None,
                   dtype: str | None = None, max_batch: int = 32, max_seq: int = 2048,
                   temperature: float = 0.0, top_k: int | None = None,
                   top_p: float | None = None, seed: int | None = None,
                   stop: Sequence[int] | None = None, ignore_eos: bool = False,
                   progress: bool = True) -> list[list[int]]:
    """Generate a list of prompts, spread over Ray replicas; results in input order.

    Args:
        prompts: texts or token-id lists.
        max_new_tokens: new tokens per prompt at most (EOS and ``stop`` ids end earlier).
        model: ``"smollm2"`` or a ``.gguf`` path (on every node).
        ray: ``False``: one local engine; ``True``: the Ray cluster ``RAY_ADDRESS`` names,
            else a local one; a string: that cluster's address (``"auto"``,
            ``"head:6379"``); a :class:`~.ray_cluster.RayReplicas`: its running replicas
            (kept running afterwards).
        replicas: replicas to start for this call (default: one per cluster GPU, or one on
            the cpu backend); they are stopped at the end.
        device: ``"cuda"`` or ``"cpu"`` replicas (default: cuda when the cluster has GPUs);
            without ``ray``, the local device (``"cpu"``, ``"cuda:1"``, ...).
        dtype, max_batch, max_seq: each engine's.
        temperature, top_k, top_p, seed, stop, ignore_eos: as ``CausalLM.generate``.
        progress: show a tqdm progress bar.

    Returns:
        One list of new token ids per prompt (EOS or the stop id included, as
        ``CausalLM.generate``).

    Raises:
        RayMissing: ``ray`` is set and Ray is not installed (``pip install 'deviceops[ray]'``).
        RuntimeError: every replica failed for good before the end.

    Example:
        >>> outs = nn.batch_generate(prompts, 64, ray="auto", replicas=8)
    """
    check_max_new_tokens(max_new_tokens, "batch_generate")
    check_sampling(temperature, top_k, top_p, seed, "batch_generate")
    if seed is None:
        seed = secrets.randbits(62)
    sampling: dict[str, Any] = {"temperature": temperature, "top_k": top_k, "top_p": top_p,
                                "seed": seed, "stop": stop, "ignore_eos": ignore_eos}
    plist = list(prompts)
    if ray is False:
        from .cli import load_engine

        engine = load_engine(model, device=device, dtype=dtype, max_batch=max_batch,
                             max_seq=max_seq)
        try:
            out: list[list[int]] = _run(lambda: abatch_generate(
                plist, max_new_tokens, [engine], progress=progress, **sampling))
        finally:
            engine.close()
        return out

    from .ray_front import RayRouter

    own = not isinstance(ray, RayReplicas)
    if isinstance(ray, RayReplicas):
        pool = ray
    else:
        address = ray if isinstance(ray, str) else None
        if device is None:
            rt = init_ray(address)
            device = "cuda" if rt.cluster_resources().get("GPU", 0) > 0 else "cpu"
        spec = ReplicaSpec(model, device, dtype, max_batch, max_seq)
        pool = RayReplicas(spec, replicas, address=address)
    try:
        router = RayRouter.attach(pool)
        engines = [r.engine for r in router.replicas if r.engine is not None]
        try:
            result: list[list[int]] = _run(lambda: abatch_generate(
                plist, max_new_tokens, engines, progress=progress, **sampling))
        finally:
            router.close()
        return result
    finally:
        if own:
            pool.shutdown()
