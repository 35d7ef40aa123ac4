"""GLM-4 architectures, checkpoint formats and the tokenizer."""

from pagedserve.models.config import GlmConfig, load_config
from pagedserve.models.tokenizer import Tokenizer

_LOADER_NAMES = ("DEMO_MODEL_DIR", "load_state_dict", "resolve_model_path")


def __getattr__(name: str):
    # the loader pulls in torch; the HTTP process needs only the tokenizer
    if name in _LOADER_NAMES:
        from pagedserve.models import loader

        return getattr(loader, name)
    raise AttributeError(f"module 'pagedserve.models' has no attribute {name!r}")


__all__ = [
    "DEMO_MODEL_DIR",
    "GlmConfig",
    "Tokenizer",
    "load_config",
    "load_state_dict",
    "resolve_model_path",
]
