"""Tool-call helpers for environments: the Hermes / Qwen ``<tool_call>`` format, parsed and answered.

Qwen2.5/Qwen3, Hermes and SmolLM2-style chat templates ask the model to call a tool as JSON
between tags, and show results to it as a ``tool`` message (which the Qwen template wraps in
``<tool_response>`` tags)::

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "12*7"}}
    </tool_call>

``parse_tool_calls(text)`` returns every complete call in a policy turn, in order, as ``ToolCall``
(name, arguments) or, for a call whose JSON is broken, a ``ToolCall`` with ``error`` set, so an
environment can answer "invalid tool call" instead of crashing. ``TOOL_CALL_STOP`` is the stop
string that ends a policy turn right after a call, so the environment answers before the model
imagines the result. ``tool_response(content)`` renders a result the way a template without tool
support would show it. ``run_tool_calls`` dispatches parsed calls to plain Python functions.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
TOOL_CALL_STOP = TOOL_CALL_CLOSE
_CALL = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)" + re.escape(TOOL_CALL_CLOSE), re.DOTALL)


@dataclass
class ToolCall:
    name: str
    arguments: dict = field(default_factory=dict)
    error: str = ""  # non-empty: the call could not be parsed (what was wrong)


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every complete ``<tool_call>{json}</tool_call>`` in ``text``, in order (see the module docstring).

    ``arguments`` may be a JSON object or a string holding one (some models write it that way);
    ``parameters`` is accepted as its other name.
    """
    calls = []
    for body in _CALL.findall(text):
        try:
            obj = json.loads(body.strip())
        except json.JSONDecodeError as e:
            calls.append(ToolCall("", {}, f"not valid JSON ({e.msg} at column {e.colno})"))
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
            calls.append(ToolCall("", {}, 'expected {"name": ..., "arguments": {...}}'))
            continue
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                calls.append(ToolCall(obj["name"], {}, "arguments is a string that is not a JSON object"))
                continue
        if not isinstance(args, dict):
            calls.append(ToolCall(obj["name"], {}, "arguments must be a JSON object"))
            continue
        calls.append(ToolCall(obj["name"], args))
    return calls


def format_tool_call(name: str, arguments: dict) -> str:
    """The text a model writes for one call (what ``parse_tool_calls`` reads back)."""
    return f"{TOOL_CALL_OPEN}\n{json.dumps({'name': name, 'arguments': arguments})}\n{TOOL_CALL_CLOSE}"


def tool_response(content: Any) -> str:
    """A tool result as Qwen's template shows it inside the user turn."""
    return f"<tool_response>\n{content}\n</tool_response>"


def run_tool_calls(calls: list[ToolCall], tools: dict[str, Callable[..., Any]]) -> list[str]:
    """One result text per call: the tool's return value, or what went wrong (unknown tool, bad
    arguments, the tool raised), written for the model to read and correct."""
    out = []
    for call in calls:
        if call.error:
            out.append(f"error: invalid tool call: {call.error}")
        elif call.name not in tools:
            out.append(f"error: unknown tool {call.name!r}; tools: {', '.join(tools)}")
        else:
            try:
                out.append(str(tools[call.name](**call.arguments)))
            except Exception as e:  # noqa: BLE001 - the model's bad call is shown to it, not raised
                out.append(f"error: {type(e).__name__}: {e}")
    return out
