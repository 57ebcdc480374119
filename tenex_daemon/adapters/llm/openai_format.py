"""The OpenAI chat format (also spoken by llama.cpp): messages, tools and tool calls as plain dicts."""

from __future__ import annotations

import json
from typing import Any

from tenex_daemon.core.context import ChatMessage
from tenex_daemon.core.llm import AssistantToolCalls, CompletionRequest, ToolCall, ToolResult


def to_openai_messages(request: CompletionRequest) -> list[dict[str, Any]]:
    """The persona as the first system message, then every message in order.

    An assistant tool-call message carries ``content: ""``, never null (llama.cpp's server answers
    HTTP 500 to null content).
    """
    messages: list[dict[str, Any]] = []
    if request.system_prompt:
        messages.append({"role": "system", "content": request.system_prompt})
    for message in request.messages:
        if isinstance(message, AssistantToolCalls):
            messages.append(
                {
                    "role": "assistant",
                    "content": message.content or "",
                    "tool_calls": [
                        {
                            "id": call.id,
                            "type": "function",
                            "function": {"name": call.name, "arguments": json.dumps(dict(call.arguments))},
                        }
                        for call in message.tool_calls
                    ],
                }
            )
        elif isinstance(message, ToolResult):
            messages.append(
                {"role": "tool", "tool_call_id": message.tool_call_id, "content": message.content}
            )
        else:
            chat: ChatMessage = message
            messages.append({"role": chat.role, "content": chat.content})
    return messages


def to_openai_tools(request: CompletionRequest) -> list[dict[str, Any]]:
    """The request's tools as OpenAI function tools."""
    return [
        {
            "type": "function",
            "function": {"name": t.name, "description": t.description, "parameters": dict(t.parameters)},
        }
        for t in request.tools
    ]


def openai_tool_choice(request: CompletionRequest) -> dict[str, Any] | None:
    """The forced tool choice, when the request names a tool."""
    if request.tool_choice is None:
        return None
    return {"type": "function", "function": {"name": request.tool_choice}}


def parse_tool_call(call_id: str | None, name: str, arguments: str | None, index: int = 0) -> ToolCall:
    """A tool call from its wire form.

    Arguments that are not a JSON object are kept, raw, in ``invalid_arguments``.
    """
    raw = arguments or ""
    parsed: Any
    try:
        parsed = json.loads(raw) if raw.strip() else {}
    except json.JSONDecodeError:
        parsed = None
    ident = call_id or f"call_{index}"
    if not isinstance(parsed, dict):
        return ToolCall(id=ident, name=name, arguments={}, invalid_arguments=raw)
    return ToolCall(id=ident, name=name, arguments=parsed)
