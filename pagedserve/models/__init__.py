"""GLM-4 architectures, checkpoint formats and the tokenizer."""

from pagedserve.models.config import GlmConfig, load_config
from pagedserve.models.loader import DEMO_MODEL_DIR, load_state_dict, resolve_model_path
from pagedserve.models.tokenizer import Tokenizer

__all__ = [
    "DEMO_MODEL_DIR",
    "GlmConfig",
    "Tokenizer",
    "load_config",
    "load_state_dict",
    "resolve_model_path",
]
