"""Serving: many requests on one or more models (continuous batching, HTTP, Ray).

| module | holds |
|---|---|
| :mod:`.engine` | :class:`Engine`: continuous batching over one model; who drives the next step |
| :mod:`.scheduler` | the engine's :class:`~.scheduler.Scheduler`: queue, running batch, one step |
| :mod:`.requests` | requests, :class:`RequestStream`, :class:`SamplingParams`, :class:`StepModel`, the errors, :class:`EngineStats` |
| :mod:`.step_model` | a ``CausalLM`` as a :class:`StepModel` |
| :mod:`.slots` | :class:`~.slots.SlotPool`: the engine's batch rows |
| :mod:`.http` | the OpenAI-compatible Starlette app (routes, SSE) |
| :mod:`.openai` | request parsing and validation, response bodies, errors |
| :mod:`.embeddings` | ``POST /v1/embeddings``: its parsing, its body, the served :class:`~deviceops.nn.Encoder` (``serve --embedding-model``) |
| :mod:`.detokenize` | incremental detokenization with stop strings |
| :mod:`.metrics`, :mod:`.access_log` | ``/metrics`` (Prometheus) and the request log |
| :mod:`.router` | one engine per device, least-loaded routing |
| :mod:`.core`, :mod:`.protocol`, :mod:`.core_client`, :mod:`.core_process` | an engine core per device in its own process: its step loop, the messages, the front's proxy of it, starting and supervising the processes |
| :mod:`.ray_cluster`, :mod:`.ray_replica`, :mod:`.ray_remote`, :mod:`.ray_front`, :mod:`.ray_batch` | replicas as Ray actors hosting engine cores: the cluster, the actor, its core client, the HTTP front, batch generation |
| :mod:`.cli` | the ``python -m deviceops.nn.serve`` command |

Serving sits above the model layers (:mod:`deviceops.nn.model`, :mod:`deviceops.nn.runner`),
which never import it. Importing this package does not import Starlette, uvicorn or Ray.
"""

from __future__ import annotations

from .engine import Engine
from .ray_batch import batch_generate
from .ray_cluster import RayMissing, RayReplicas, ReplicaSpec
from .requests import (
    EngineClosed,
    EngineFailed,
    EngineOverloaded,
    EngineStats,
    RequestStream,
    SamplingParams,
    StepModel,
)

__all__ = ["Engine", "EngineClosed", "EngineFailed", "EngineOverloaded", "EngineStats",
           "RayMissing", "RayReplicas", "ReplicaSpec", "RequestStream", "SamplingParams",
           "StepModel", "batch_generate"]
