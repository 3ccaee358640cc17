"""Model-output parsers, per model family: tool calls (tool_calls.py, formats in
tool_formats.py) and reasoning blocks (reasoning.py). Text in, OpenAI pieces out; the same
incremental parser serves streamed and whole outputs, so both always agree."""

from minisgl.parsers.reasoning import REASONING_PARSERS, ReasoningParser
from minisgl.parsers.tool_calls import ArgsDelta, CallStart, TextDelta, ToolCallParser, parse_tool_calls
from minisgl.parsers.tool_formats import TOOL_FORMATS, detect_tool_format

__all__ = [
    "REASONING_PARSERS",
    "TOOL_FORMATS",
    "ArgsDelta",
    "CallStart",
    "ReasoningParser",
    "TextDelta",
    "ToolCallParser",
    "detect_tool_format",
    "parse_tool_calls",
]
