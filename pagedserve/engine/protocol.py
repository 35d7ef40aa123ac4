"""``EngineClient``: what the HTTP server reads of the engine it serves, as vLLM's
``vllm.engine.protocol.EngineClient``. ``AsyncLLMEngine`` is one (one engine core); the Ray
Serve ingress's client of several data-parallel replicas is another
(``entrypoints.ray_serve.ingress.ReplicasEngine``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagedserve.engine.limits import EngineLimits
    from pagedserve.outputs import RequestOutput
    from pagedserve.sampling_params import SamplingParams


class EngineClient(ABC):
    limits: EngineLimits
    model: str  # the model's path, as loaded
    tokenizer: Any  # the model's tokenizer (None: the model has none)
    stats: dict[str, Any]  # the engine's figures for /metrics
    max_queue_len: int | None  # waiting requests beyond which admission answers 503
    draining: bool  # admitting nothing new (shutting down)
    dead_error: str | None  # why the engine is not running (None: it runs)

    @abstractmethod
    def start(self) -> None:
        """Start serving, on the serving event loop (the app's lifespan)."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop; idempotent."""

    @property
    @abstractmethod
    def is_alive(self) -> bool: ...

    @abstractmethod
    def health(self) -> dict[str, Any]:
        """What ``/health`` answers while alive."""

    @property
    @abstractmethod
    def num_waiting(self) -> int: ...

    @property
    @abstractmethod
    def num_unfinished(self) -> int: ...

    @abstractmethod
    def queue_full(self) -> bool: ...

    @abstractmethod
    def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """The request's outputs until it finishes; aborted if the consumer goes away."""

    @abstractmethod
    async def call_utility(self, name: str, *args: Any) -> Any:
        """The engine core's ``name(*args)``, between two of its steps."""

    @abstractmethod
    def tokens_per_second(self) -> float: ...

    async def get_device_stats(self) -> dict | list[dict]:
        return await self.call_utility("get_device_stats")

    async def get_page_map(self) -> dict:
        return await self.call_utility("get_page_map")

    async def reset_prefix_cache(self) -> bool:
        return await self.call_utility("reset_prefix_cache")
