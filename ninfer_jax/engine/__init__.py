"""The Engine control plane (DESIGN §2-§8): pure Python, imports no jax.

Owns order, lifecycle and publication: the worker thread, FIFO and Scheduler, lanes, request
records and their events. It drives any object with the HostProgram interface.
"""

from ninfer_jax.engine.config import EngineCoreConfig
from ninfer_jax.engine.core import EngineCore
from ninfer_jax.engine.events import (
    Channel,
    Delta,
    EngineError,
    EngineFailedError,
    Finished,
    FinishReason,
    GenerationResult,
    GenerationStart,
    RejectedError,
    TokenLogprob,
    Usage,
)
from ninfer_jax.engine.handle import AsyncRequestHandle, AsyncTextStream, RequestHandle, TextStream
from ninfer_jax.engine.stats import EngineStats, RoundStats

__all__ = [
    "AsyncRequestHandle",
    "AsyncTextStream",
    "Channel",
    "Delta",
    "EngineCore",
    "EngineCoreConfig",
    "EngineError",
    "EngineFailedError",
    "EngineStats",
    "FinishReason",
    "Finished",
    "GenerationResult",
    "GenerationStart",
    "RejectedError",
    "RequestHandle",
    "RoundStats",
    "TextStream",
    "TokenLogprob",
    "Usage",
]
