"""Tool-call parsers by name (``--tool-call-parser``): the built-in ones register on import."""

from pagedserve.server.tool_parsers.abstract_tool_parser import (
    CallSegment,
    ExtractedToolCalls,
    TextSegment,
    ToolParser,
    ToolParserManager,
)
from pagedserve.server.tool_parsers.glm4_tool_parser import Glm4ToolParser
from pagedserve.server.tool_parsers.glm45_tool_parser import Glm45ToolParser

__all__ = [
    "CallSegment",
    "ExtractedToolCalls",
    "Glm4ToolParser",
    "Glm45ToolParser",
    "TextSegment",
    "ToolParser",
    "ToolParserManager",
]
