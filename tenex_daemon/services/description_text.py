"""The words of a conversation's description: the prompt a model is sent, the parsing of its answer,
and the fallback text used when the model fails (docs/ARCHITECTURE.md, "Conversation lifecycle").

Pure functions, no I/O. Small models answer loosely, so the parser takes a JSON object (bare, in a
code fence, or with chatter around it), else ``Title:`` / ``Summary:`` lines; it clips a title to
:data:`TITLE_MAX_WORDS` words and a summary to :data:`SUMMARY_MAX_SENTENCES` sentences.
"""

from __future__ import annotations

import contextlib
import html
import json
import re
from dataclasses import dataclass
from typing import Any

from tenex_daemon.core.agents import AgentDirectory, AuthorRole
from tenex_daemon.core.conversation import Conversation
from tenex_daemon.core.events import NostrEvent
from tenex_daemon.core.vocabulary import ERROR_SYSTEM, TAG_ERROR

TITLE_MAX_WORDS = 8
TITLE_MAX_CHARS = 90
SUMMARY_MAX_SENTENCES = 3
SUMMARY_MAX_CHARS = 600
FALLBACK_TITLE_WORDS = 6
FALLBACK_QUOTE_WORDS = 20
MESSAGE_CHARS = 700
"""Each message is cut to this many characters in the transcript a model is sent."""
DEFAULT_PROMPT_CHARS = 4000
"""The transcript's size limit (characters): about 1,000 tokens, room for a small model's 2,048."""
PERSON = "Person"

SYSTEM_PROMPT = "You write titles and summaries of conversations. You answer with a JSON object only."
QUESTION = (
    'Write a JSON object with two keys: "title" (5 to 8 words naming the topic) and "summary" '
    "(2 or 3 sentences saying what was asked and what was answered)."
)
"""Concrete words, no placeholder to fill in: small models copy placeholders instead of filling them."""
SUMMARY_SYSTEM_PROMPT = "You summarize conversations in plain sentences."
SUMMARY_QUESTION = (
    "Summarize this conversation in 2 or 3 sentences: what was asked and what was answered. "
    "Write only the sentences."
)
"""Asked alone when the first answer gave no summary: small models write plain sentences far more
often than a summary inside a JSON object."""
_PLACEHOLDERS = {"title", "summary", "5 to 8 words naming the topic", "a title of 5 to 8 words"}
"""Words of the prompt: a model that echoes them as its title or summary gave none."""


@dataclass(frozen=True, slots=True)
class Description:
    """What a model's answer gave: a title and a summary, either missing (None) when it gave none."""

    title: str | None
    summary: str | None


NO_DESCRIPTION = Description(None, None)


# --- the prompt -------------------------------------------------------------------------------


def speaker(event: NostrEvent, conversation: Conversation, agents: AgentDirectory) -> str | None:
    """Who wrote ``event`` as the transcript names them (an agent's name, "Person"); None: the
    project's own events, left out."""
    agent = agents.by_pubkey(event.pubkey)
    if agent is not None:
        return agent.name
    role = agents.role_of(event.pubkey, conversation.claims_agent(event.pubkey))
    if role is AuthorRole.PROJECT:
        return None
    return "Another agent" if role is AuthorRole.FOREIGN_AGENT else PERSON


def count_exchanges(conversation: Conversation, agents: AgentDirectory) -> int:
    """Exchanges so far: the smaller of how many events people wrote and how many the project's
    agents wrote (a person's message and an agent's answer make one)."""
    people = answers = 0
    for event in conversation.history:
        role = agents.role_of(event.pubkey, conversation.claims_agent(event.pubkey))
        if role is AuthorRole.USER:
            people += 1
        elif role is AuthorRole.AGENT:
            answers += 1
    return min(people, answers)


def _one_line(text: str, limit: int) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 1].rstrip() + "…"


def transcript(
    conversation: Conversation, agents: AgentDirectory, max_chars: int = DEFAULT_PROMPT_CHARS
) -> str:
    """The conversation as ``Name: text`` lines, each cut to :data:`MESSAGE_CHARS`; over ``max_chars``,
    the first message and the newest that fit are kept, with a line saying how many were left out."""
    lines: list[str] = []
    for event in conversation.history:
        name = speaker(event, conversation, agents)
        if name is not None and event.content.strip():
            lines.append(f"{name}: {_one_line(event.content, MESSAGE_CHARS)}")
    if sum(len(line) + 1 for line in lines) <= max_chars or len(lines) < 2:
        return "\n".join(lines)[:max_chars]
    first, kept, used = lines[0], [], len(lines[0]) + 1
    for line in reversed(lines[1:]):
        if used + len(line) + 1 > max_chars - 40:
            break
        kept.append(line)
        used += len(line) + 1
    kept.reverse()
    left_out = len(lines) - 1 - len(kept)
    return "\n".join([first, f"[{left_out} messages left out]", *kept])


def user_prompt(
    conversation: Conversation,
    agents: AgentDirectory,
    max_chars: int = DEFAULT_PROMPT_CHARS,
    question: str = QUESTION,
) -> str:
    """The message a model is sent: the transcript, then what to write (last: small models follow best
    what they read last)."""
    return f"Conversation:\n{transcript(conversation, agents, max_chars)}\n\n{question}"


# --- parsing the answer -----------------------------------------------------------------------

_FENCE = re.compile(r"```[a-zA-Z]*\s*(.*?)```", re.DOTALL)
_LABEL = re.compile(r"^[\s>*#_\-]*(title|summary)[\s*_]*[:：=\-–]\s*(.*)$", re.IGNORECASE)
_QUOTES = "\"'“”‘’«»`"
_MEMBER = re.compile(r'"([A-Za-z_]+)"\s*:\s*("(?:[^"\\]|\\.)*")')
"""A JSON ``"key": "text"`` member, read where the object around it does not parse (cut short)."""
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=\S)")


def _with_nested(value: dict[str, Any]) -> list[dict[str, Any]]:
    """The object, then every object inside it (depth first)."""
    found = [value]
    for inner in value.values():
        if isinstance(inner, dict):
            found += _with_nested(inner)
    return found


def _json_objects(text: str) -> list[dict[str, Any]]:
    """Every JSON object in ``text`` with the objects inside them: those in code fences first, then those
    in the whole text."""
    found: list[dict[str, Any]] = []
    decoder = json.JSONDecoder()
    for candidate in [m.group(1) for m in _FENCE.finditer(text)] + [text]:
        start = candidate.find("{")
        while start >= 0:
            try:
                value, end = decoder.raw_decode(candidate, start)
            except json.JSONDecodeError:
                start = candidate.find("{", start + 1)
                continue
            if isinstance(value, dict):
                found += _with_nested(value)
            start = candidate.find("{", end)
    return found


def _members(text: str) -> dict[str, Any]:
    """The whole ``"key": "text"`` members of a JSON object that does not parse (a model's answer cut
    off at its token limit keeps the members written before the cut), the first of each key."""
    found: dict[str, Any] = {}
    for match in _MEMBER.finditer(text):
        with contextlib.suppress(json.JSONDecodeError):
            found.setdefault(match.group(1), json.loads(match.group(2)))
    return found


def _field(data: dict[str, Any], *names: str) -> str | None:
    """The first of ``names`` (any case) whose value is text; an object there gives its own first text
    under those names (small models nest their answer)."""
    lowered = {str(key).strip().casefold(): value for key, value in data.items()}
    for name in names:
        value = lowered.get(name)
        if isinstance(value, dict):
            value = _field(value, *names)
        if isinstance(value, str) and value.strip():
            return value
    return None


def _labelled(text: str) -> tuple[str | None, str | None]:
    """``Title: …`` and ``Summary: …`` lines (a summary may go on over the lines that follow)."""
    values: dict[str, list[str]] = {}
    current: str | None = None
    for line in text.splitlines():
        match = _LABEL.match(line)
        if match is not None:
            current = match.group(1).casefold()
            values[current] = [match.group(2)] if match.group(2).strip() else []
        elif current is not None and line.strip():
            if current == "title" and values[current]:
                current = None  # a title is one line: what follows is chatter
            else:
                values[current].append(line)
        elif current is not None and values.get(current):
            current = None  # a blank line ends the value
    title = " ".join(values.get("title", [])) or None
    summary = " ".join(values.get("summary", [])) or None
    return title, summary


def _clean(text: str) -> str:
    flat = " ".join(text.replace("**", "").replace("__", "").split())
    flat = flat.strip().strip(_QUOTES).strip()
    words = flat.casefold().strip(" <>.…:")
    return "" if not words or words in _PLACEHOLDERS else flat


def clean_title(text: str | None) -> str | None:
    """A title as stored: one line, no quotes or markdown, at most :data:`TITLE_MAX_WORDS` words and
    :data:`TITLE_MAX_CHARS` characters, no closing full stop; None when nothing is left."""
    if text is None:
        return None
    title = _clean(text).lstrip("# ").rstrip(" .;:,")
    words = title.split()[:TITLE_MAX_WORDS]
    while words and len(" ".join(words)) > TITLE_MAX_CHARS:
        words.pop()
    title = " ".join(words) or title[:TITLE_MAX_CHARS]
    return title or None


def clean_summary(text: str | None) -> str | None:
    """A summary as stored: one paragraph of at most :data:`SUMMARY_MAX_SENTENCES` sentences and
    :data:`SUMMARY_MAX_CHARS` characters; None when nothing is left."""
    if text is None:
        return None
    summary = _clean(text)
    summary = " ".join(_SENTENCE_END.split(summary)[:SUMMARY_MAX_SENTENCES])
    if len(summary) > SUMMARY_MAX_CHARS:
        summary = summary[: SUMMARY_MAX_CHARS - 1].rsplit(" ", 1)[0].rstrip(" ,;:") + "…"
    return summary or None


def parse_description(text: str) -> Description:
    """Read a model's answer: a JSON object with ``title`` and ``summary`` (fenced or among chatter),
    else the whole members of one cut short, else ``Title:`` and ``Summary:`` lines; what is missing
    or empty is None. HTML entities some chat templates leave in the text are read as the characters
    they stand for."""
    text = html.unescape(text)
    for data in [*_json_objects(text), _members(text)]:
        title = clean_title(_field(data, "title", "name", "heading"))
        summary = clean_summary(_field(data, "summary", "description", "abstract"))
        if title is not None or summary is not None:
            return Description(title, summary)
    title, summary = _labelled(text)
    return Description(clean_title(title), clean_summary(summary))


# --- fallback text ----------------------------------------------------------------------------

_NOSTR_URI = re.compile(r"nostr:[a-z0-9]+", re.IGNORECASE)
_URL = re.compile(r"https?://\S+")


def _first_person_message(conversation: Conversation, agents: AgentDirectory) -> str:
    for event in conversation.history:
        if speaker(event, conversation, agents) == PERSON:
            text = _URL.sub("", _NOSTR_URI.sub("", event.content))
            text = " ".join(text.replace("**", "").split()).strip(_QUOTES + " ")
            if text:
                return text
    return ""


def _agent_names(
    conversation: Conversation, agents: AgentDirectory, events: list[NostrEvent] | None = None
) -> list[str]:
    names: dict[str, None] = {}
    for event in conversation.history if events is None else events:
        agent = agents.by_pubkey(event.pubkey)
        if agent is not None:
            names[agent.name] = None
    return list(names)


def fallback_title(conversation: Conversation, agents: AgentDirectory) -> str:
    """A title without a model: the first words of the first person's first message, else who talked."""
    words = _first_person_message(conversation, agents).split()
    if words:
        title = clean_title(" ".join(words[:FALLBACK_TITLE_WORDS]))
        if title:
            return title + ("…" if len(words) > FALLBACK_TITLE_WORDS else "")
    names = _agent_names(conversation, agents)
    return f"Conversation with {', '.join(names)}" if names else "Conversation"


def fallback_summary(conversation: Conversation, agents: AgentDirectory) -> str:
    """A plain sentence about the conversation without a model: who, how many messages, how it began.
    Whether it has ended is left to the status beside it (kind 513's ``status``, the API's): a new
    message reopens a conversation and keeps its description."""
    # the daemon's own notices (a stop's, a failure's: tagged as system errors) are no messages said
    said = [e for e in conversation.history if not e.has_tag(TAG_ERROR, ERROR_SYSTEM)]
    names = _agent_names(conversation, agents, said)
    count = len(said)
    who = f"a person and {', '.join(names)}" if names else "a person"
    parts = [f"A conversation of {count} message{'' if count == 1 else 's'} between {who}."]
    words = _first_person_message(conversation, agents).split()
    if words:
        quote = " ".join(words[:FALLBACK_QUOTE_WORDS]) + ("…" if len(words) > FALLBACK_QUOTE_WORDS else "")
        parts.append(f"It began with: “{quote}”.")
    return " ".join(parts)
