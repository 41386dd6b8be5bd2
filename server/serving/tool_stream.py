"""Tool calls out of streamed output text: plain content, and the calls between the markers.

The model's answer is text; with tools offered, the parts between a format's markers (see
``server/serving/tool_parsers.py``) are tool calls::

    "Let me check.\\n<tool_call>\\n{"name": "f", "arguments": {"x": 1}}\\n</tool_call>"
    -> content "Let me check.", one call f({"x": 1})

``ToolCallSplitter`` does this on text as it streams, in any chunking: text that could
still be the start of a marker is held back until it is certain, and a call is parsed once
its end marker arrives (or the output ends), so the concatenation of what ``feed`` and
``flush`` return is the same whatever the split. Whitespace next to a call (before it,
between calls, after the last) is dropped. A call that does not parse stays in the content
as the model wrote it, markers included; with ``parallel_tool_calls: false`` only the
first call is kept.
"""

from __future__ import annotations

import json
import logging
import uuid
from dataclasses import dataclass, field
from typing import Any

from mlxserve.server.http.json_body import strict_json_text
from mlxserve.server.serving.stop_strings import partial_suffix_len
from mlxserve.server.serving.tool_parsers import ToolFormat

logger = logging.getLogger(__name__)


def new_call_id() -> str:
    """An OpenAI-style tool call id, ``call_`` + 24 random characters."""
    return "call_" + uuid.uuid4().hex[:24]


@dataclass(frozen=True)
class ParsedCall:
    """One tool call: the function's name and its arguments as a JSON object's text."""

    name: str
    arguments: str
    id: str = field(default_factory=new_call_id)


def parse_calls(fmt: ToolFormat, text: str, tools: list[dict[str, Any]] | None) -> list[ParsedCall]:
    """The calls in ``text`` (what was between the markers).

    Raises:
        ValueError: the text is not a call of this format.
    """
    try:
        parsed = fmt.parse(text, tools)
    except Exception as e:  # noqa: BLE001 - third-party parsers raise all sorts of errors
        raise ValueError(f"{type(e).__name__}: {e}") from e
    calls = parsed if isinstance(parsed, list) else [parsed]
    out = []
    for call in calls:
        name = call.get("name") if isinstance(call, dict) else None
        if not isinstance(name, str) or not name:
            raise ValueError("a tool call needs a function name")
        arguments = call.get("arguments", call.get("parameters", {}))
        if isinstance(arguments, str):
            arguments = strict_json_text(arguments)  # a ValueError when it is not JSON
        if not isinstance(arguments, dict):
            raise ValueError("tool call arguments must be a JSON object")
        out.append(ParsedCall(name, json.dumps(arguments, ensure_ascii=False)))
    return out


class ToolCallSplitter:
    """Splits streamed content into ``(plain text, completed tool calls)``.

    Args:
        fmt: the tool-call format of the output.
        tools: the request's tools (OpenAI dicts; some parsers look at parameter types).
        parallel: keep every call (False: only the first).

    Attributes:
        calls_made: tool calls returned so far.
    """

    def __init__(
        self, fmt: ToolFormat, tools: list[dict[str, Any]] | None, parallel: bool = True
    ) -> None:
        self._fmt = fmt
        self._tools = tools
        self._parallel = parallel
        self._in_call = False
        self._after_call = False  # only whitespace since the last call: drop it
        self._held = ""  # in text: a possible marker start (+ whitespace); in a call: its body
        self.calls_made = 0

    def feed(self, text: str) -> tuple[str, list[ParsedCall]]:
        """Add the next piece of content; returns the text and the calls now certain."""
        content: list[str] = []
        calls: list[ParsedCall] = []
        buf = self._held + text
        self._held = ""
        while buf:
            buf = (
                self._in_call_step(buf, content, calls)
                if self._in_call
                else self._text_step(buf, content)
            )
        return "".join(content), calls

    def flush(self) -> tuple[str, list[ParsedCall]]:
        """What is held back at the end of the output (an unclosed call is parsed as is)."""
        held, self._held = self._held, ""
        content: list[str] = []
        calls: list[ParsedCall] = []
        if self._in_call:
            self._in_call = False
            self._finish_call(held, content, calls, closed=False)
        elif not (self._after_call and not held.strip()):
            content.append(held)
        return "".join(content), calls

    def _text_step(self, buf: str, content: list[str]) -> str:
        start = self._fmt.start
        if self._after_call:
            buf = buf.lstrip()
            if not buf:
                return ""
        at = buf.find(start)
        if at >= 0:
            content.append(buf[:at].rstrip())
            self._in_call = True
            self._after_call = False
            return buf[at + len(start) :]
        keep = len(buf) - partial_suffix_len(buf, (start,))
        keep = len(buf[:keep].rstrip())  # whitespace before a call is dropped: hold it
        if buf[:keep]:
            self._after_call = False
        content.append(buf[:keep])
        self._held = buf[keep:]
        return ""

    def _in_call_step(self, buf: str, content: list[str], calls: list[ParsedCall]) -> str:
        end = self._fmt.end
        at = buf.find(end) if end else -1
        if at < 0:
            self._held = buf
            return ""
        self._in_call = False
        self._finish_call(buf[:at], content, calls, closed=True)
        return buf[at + len(end) :]

    def _finish_call(
        self, body: str, content: list[str], calls: list[ParsedCall], closed: bool
    ) -> None:
        try:
            parsed = parse_calls(self._fmt, body, self._tools)
        except ValueError as e:
            logger.info("tool call left as text, it does not parse (%s)", e)
            content.append(self._fmt.start + body + (self._fmt.end if closed else ""))
            return
        if not self._parallel:
            parsed = parsed[: max(0, 1 - self.calls_made)]
        self.calls_made += len(parsed)
        calls.extend(parsed)
        self._after_call = True


def split_tool_calls(
    fmt: ToolFormat, text: str, tools: list[dict[str, Any]] | None, parallel: bool = True
) -> tuple[str, list[ParsedCall]]:
    """The whole output split at once: ``(content, calls)``."""
    splitter = ToolCallSplitter(fmt, tools, parallel)
    content, calls = splitter.feed(text)
    tail, more = splitter.flush()
    return content + tail, calls + more
