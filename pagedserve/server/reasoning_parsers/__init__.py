"""Reasoning parsers by name (``--reasoning-parser``): the built-in ones register on import."""

from pagedserve.server.reasoning_parsers.abstract_reasoning_parser import (
    ReasoningParser,
    ReasoningParserManager,
)
from pagedserve.server.reasoning_parsers.glm4_reasoning_parser import Glm4ReasoningParser

__all__ = ["Glm4ReasoningParser", "ReasoningParser", "ReasoningParserManager"]
