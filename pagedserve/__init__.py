"""pagedserve: a paged LLM inference engine for GLM-4 with INT4 weights."""

from pagedserve.outputs import CompletionOutput, RequestOutput
from pagedserve.sampling_params import SamplingParams

__version__ = "0.1.0"


def __getattr__(name: str):
    # LLM pulls in torch; keep `import pagedserve` (and the SDK) light.
    if name == "LLM":
        from pagedserve.entrypoints.llm import LLM

        return LLM
    if name == "LoRARequest":  # vLLM's `from vllm.lora.request import LoRARequest`, at the top
        from pagedserve.lora.request import LoRARequest

        return LoRARequest
    raise AttributeError(f"module 'pagedserve' has no attribute {name!r}")


__all__ = [
    "LLM",
    "LoRARequest",
    "CompletionOutput",
    "RequestOutput",
    "SamplingParams",
    "__version__",
]
