"""GLM-4 architectures, checkpoint formats and the tokenizer."""

from pagedserve.models.config import GlmConfig, load_config
from pagedserve.models.loader import load_state_dict
from pagedserve.models.tokenizer import Tokenizer

__all__ = ["GlmConfig", "Tokenizer", "load_config", "load_state_dict"]
