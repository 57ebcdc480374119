"""Wire formats: OpenAI messages and tools, Anthropic turns, tool-call argument parsing."""

from __future__ import annotations

from tenex_daemon.adapters.llm.anthropic import to_anthropic_messages
from tenex_daemon.adapters.llm.openai_format import (
    openai_tool_choice,
    parse_tool_call,
    to_openai_messages,
    to_openai_tools,
)
from tenex_daemon.core.context import ChatMessage
from tenex_daemon.core.llm import AssistantToolCalls, CompletionRequest, ToolCall, ToolResult, ToolSpec

WEATHER = ToolSpec(
    name="get_weather",
    description="The weather in a city.",
    parameters={"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
)
CALL = ToolCall(id="call_1", name="get_weather", arguments={"city": "Paris"})


def request_with_tool_pair() -> CompletionRequest:
    """A conversation where the assistant called a tool and got its result."""
    return CompletionRequest(
        agent_slug="alice",
        agent_name="Alice",
        system_prompt="You are Alice.",
        messages=[
            ChatMessage("user", "Weather in Paris?"),
            ChatMessage("system", "[Bob]: I think it rains."),
            AssistantToolCalls(tool_calls=(CALL,)),
            ToolResult(tool_call_id="call_1", name="get_weather", content="sunny"),
        ],
        tools=(WEATHER,),
        tool_choice="get_weather",
    )


def test_openai_messages_keep_order_roles_and_tool_pairs() -> None:
    """The persona comes first, roles are kept, a tool call has content "" and its result follows it."""
    messages = to_openai_messages(request_with_tool_pair())
    assert [m["role"] for m in messages] == ["system", "user", "system", "assistant", "tool"]
    assert messages[0]["content"] == "You are Alice."
    assistant = messages[3]
    assert assistant["content"] == ""
    assert assistant["tool_calls"] == [
        {
            "id": "call_1",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
        }
    ]
    assert messages[4] == {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}


def test_openai_tools_and_forced_choice() -> None:
    """Tools become function tools with their JSON schema; tool_choice names the forced function."""
    request = request_with_tool_pair()
    assert to_openai_tools(request) == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "The weather in a city.",
                "parameters": dict(WEATHER.parameters),
            },
        }
    ]
    assert openai_tool_choice(request) == {"type": "function", "function": {"name": "get_weather"}}


def test_no_persona_no_system_message() -> None:
    """An empty persona adds no system message."""
    request = CompletionRequest(
        agent_slug="a", agent_name="A", system_prompt="", messages=[ChatMessage("user", "hi")]
    )
    assert to_openai_messages(request) == [{"role": "user", "content": "hi"}]
    assert openai_tool_choice(request) is None


def test_tool_call_arguments_are_parsed_or_kept_raw() -> None:
    """JSON-object arguments are parsed; anything else is kept in invalid_arguments with empty arguments."""
    assert parse_tool_call("c", "f", '{"a": 1}') == ToolCall(id="c", name="f", arguments={"a": 1})
    assert parse_tool_call(None, "f", "", 2) == ToolCall(id="call_2", name="f", arguments={})
    broken = parse_tool_call("c", "f", '{"a": ')
    assert (broken.arguments, broken.invalid_arguments) == ({}, '{"a": ')
    listed = parse_tool_call("c", "f", "[1]")
    assert listed.invalid_arguments == "[1]"


def test_anthropic_turns_alternate_and_keep_tool_pairs() -> None:
    """System messages become user text merged with the user turn; tool_use and tool_result stay paired."""
    turns = to_anthropic_messages(request_with_tool_pair())
    assert [t["role"] for t in turns] == ["user", "assistant", "user"]
    assert turns[0]["content"] == [
        {"type": "text", "text": "Weather in Paris?"},
        {"type": "text", "text": "[Bob]: I think it rains."},
    ]
    assert turns[1]["content"] == [
        {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {"city": "Paris"}}
    ]
    assert turns[2]["content"] == [
        {"type": "tool_result", "tool_use_id": "call_1", "content": "sunny", "is_error": False}
    ]


def test_anthropic_conversation_starts_with_a_user_turn() -> None:
    """A history that starts with the agent's own reply gets a user turn before it."""
    request = CompletionRequest(
        agent_slug="a",
        agent_name="A",
        system_prompt="",
        messages=[ChatMessage("assistant", "Hello!"), ChatMessage("user", "Hi"), ChatMessage("user", "")],
    )
    turns = to_anthropic_messages(request)
    assert [t["role"] for t in turns] == ["user", "assistant", "user"]
    assert turns[2]["content"] == [{"type": "text", "text": "Hi"}]
