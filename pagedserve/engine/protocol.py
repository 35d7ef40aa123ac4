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
    lora_enabled: bool = False  # the engine serves LoRA adapters (--enable-lora)
    # the loaded adapters by name: {"name", "id", "path", "base_model_name"}
    lora_adapters: dict[str, dict] = {}

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
        lora_name: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """The request's outputs until it finishes; aborted if the consumer goes away.
        ``lora_name``: a loaded LoRA adapter it runs with (None: the base model)."""

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

    async def load_lora_adapter(self, lora_name: str, lora_path: str) -> dict:
        """``{"adapter": info}``, or ``{"error": why}`` (an engine that cannot says so)."""
        return {"error": f"{type(self).__name__} does not load LoRA adapters at run time"}

    async def unload_lora_adapter(self, lora_name: str) -> dict:
        """``{}``, or ``{"error": why}`` (``not_found``, or ``in_use`` naming the requests)."""
        return {"error": f"{type(self).__name__} does not unload LoRA adapters at run time"}
