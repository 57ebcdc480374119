"""The control API's inputs checked: ids, query parameters and request bodies (400 on anything malformed)."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any, Final

from tenex_daemon.app.control.errors import ApiError
from tenex_daemon.app.home import parse_pubkey
from tenex_daemon.app.rebuild import RebuildRequest
from tenex_daemon.core.phases import BUILT_IN_PHASES, Phase

MAX_LIMIT: Final = 10_000
DATE_ALIASES: Final = {"from": "date_from", "to": "date_to"}
"""Other spellings of the date filters (``from``/``to``), accepted as the same parameters."""
SEARCH_PARAMETERS: Final = frozenset(
    {"id_prefix", "title", "phase", "archived", "date_from", "date_to", "participant", "limit", *DATE_ALIASES}
)
_HEX_ID = re.compile(r"[0-9a-f]{64}")
_HEX_PREFIX = re.compile(r"[0-9a-f]{1,64}")
_DATE_ONLY = re.compile(r"\d{4}-\d{2}-\d{2}")
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


def check_id(value: str, what: str = "conversation id") -> str:
    """Return ``value`` if it is 64 lowercase hex characters, else raise :class:`ApiError` 400."""
    if not _HEX_ID.fullmatch(value):
        raise ApiError(400, f"{what} must be 64 lowercase hex characters, got {value[:80]!r}")
    return value


def _parse_bool(name: str, value: str) -> bool:
    lowered = value.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise ApiError(400, f"{name} must be true or false, got {value!r}")


def parse_datetime(name: str, value: str) -> datetime:
    """Parse ISO 8601 (date or date-time; naive means UTC) or Unix seconds; raise ApiError 400."""
    text = value.strip()
    try:
        if re.fullmatch(r"\d+(\.\d+)?", text):
            return datetime.fromtimestamp(float(text), UTC)
        moment = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except (ValueError, OverflowError, OSError):
        raise ApiError(400, f"{name} must be an ISO 8601 date or Unix seconds, got {value!r}") from None
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


def _parse_phase(value: str, phases: Sequence[Phase]) -> Phase:
    """A phase to search by: one of the seven built in (a conversation stored before the project's table
    changed, or imported, may be in any of them) or one the project added."""
    name = value.strip().lower()
    known = dict.fromkeys((*BUILT_IN_PHASES, *phases))
    if name not in known:
        raise ApiError(400, f"phase must be one of {', '.join(known)}, got {value!r}")
    return Phase(name)


def _parse_participant(value: str) -> str:
    try:
        return parse_pubkey(value)
    except ValueError as exc:
        raise ApiError(400, f"participant: {exc}") from None


def _parse_id_prefix(value: str) -> str:
    lowered = value.lower()
    if not _HEX_PREFIX.fullmatch(lowered):
        raise ApiError(400, f"id_prefix must be 1 to 64 hex characters, got {value[:80]!r}")
    return lowered


def _parse_limit(raw: str) -> int:
    # isdecimal, not isdigit: a superscript ("²") is a digit that int() cannot read (it raised: a 500); the
    # length before int(), which refuses more than 4,300 digits, leading zeros included (a 500 too)
    digits = raw.lstrip("0")
    if not raw.isdecimal() or len(digits) > len(str(MAX_LIMIT)) or not 1 <= int(digits or "0") <= MAX_LIMIT:
        raise ApiError(400, f"limit must be an integer from 1 to {MAX_LIMIT}, got {raw[:80]!r}")
    return int(digits)


def parse_search(query: Mapping[str, str], phases: Sequence[Phase] = BUILT_IN_PHASES) -> dict[str, Any]:
    """Turn query parameters into keyword arguments of ``search_conversations``; raise ApiError 400
    (``phases``: the project's, which a ``phase`` may name besides the seven built in)."""
    unknown = sorted(set(query) - SEARCH_PARAMETERS)
    if unknown:
        known = ", ".join(sorted(SEARCH_PARAMETERS))
        raise ApiError(400, f"unknown parameter(s): {', '.join(unknown)} (known: {known})")
    args: dict[str, Any] = {}
    if query.get("id_prefix"):
        args["id_prefix"] = _parse_id_prefix(query["id_prefix"])
    if query.get("title"):
        args["title"] = query["title"]
    if query.get("phase"):
        args["phase"] = _parse_phase(query["phase"], phases)
    if query.get("archived"):
        args["archived"] = _parse_bool("archived", query["archived"])
    for alias, name in DATE_ALIASES.items():
        if query.get(alias) and query.get(name):
            raise ApiError(400, f"give {name} or {alias}, not both")
        spelled = alias if query.get(alias) else name
        if query.get(spelled):
            moment = parse_datetime(spelled, query[spelled])
            if name == "date_to" and _DATE_ONLY.fullmatch(query[spelled].strip()):
                moment += timedelta(days=1) - timedelta(milliseconds=1)  # a day given "to": the whole UTC day
            args[name] = moment
    if query.get("participant"):
        args["participant"] = _parse_participant(query["participant"])
    if query.get("limit"):
        args["limit"] = _parse_limit(query["limit"])
    return args


def parse_reset_body(body: object) -> bool:
    """Return ``keep_system_message`` of a reset's decoded JSON body (None: no body); raise ApiError 400."""
    if body is None:
        return False
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    value = body.get("keep_system_message", False)
    if not isinstance(value, bool):
        raise ApiError(400, "keep_system_message must be true or false")
    return value


def parse_end_body(body: object) -> str | None:
    """Return the ``reason`` of an end request's decoded JSON body (None: no body, no reason); raise
    ApiError 400."""
    if body is None:
        return None
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    reason = body.get("reason")
    if reason is not None and not isinstance(reason, str):
        raise ApiError(400, "reason must be a string")
    return reason or None


def parse_stop_body(body: object) -> str | None:
    """Return the ``agent`` slug of a stop request's decoded JSON body (None: every agent); raise
    ApiError 400."""
    if body is None:
        return None
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    agent = body.get("agent")
    if agent is not None and not isinstance(agent, str):
        raise ApiError(400, "agent must be a string (an agent's slug)")
    return agent or None


def parse_context_query(query: Mapping[str, str]) -> tuple[str, str | None]:
    """Return the (agent slug, trigger event id or None) of a context request; raise ApiError 400."""
    agent = query.get("agent")
    if not agent:
        raise ApiError(400, "the agent query parameter is required (?agent=SLUG)")
    trigger = query.get("trigger")
    if trigger is not None:
        check_id(trigger, "trigger event id")
    return agent, trigger


REBUILD_FIELDS: Final = frozenset({"id", "all", "since"})


def parse_rebuild_body(body: object) -> RebuildRequest:
    """Return the request of a rebuild's decoded JSON body: ``{"id": ...}`` or ``{"all": true}``, with an
    optional ``"since"`` (ISO 8601 or Unix seconds); raise ApiError 400."""
    if not isinstance(body, dict):
        raise ApiError(400, 'the body must be a JSON object: {"id": "<conversation id>"} or {"all": true}')
    unknown = sorted(set(body) - REBUILD_FIELDS)
    if unknown:
        raise ApiError(400, f"unknown field(s): {', '.join(unknown)} (known: all, id, since)")
    conversation_id, all_, since = body.get("id"), body.get("all", False), body.get("since")
    if conversation_id is not None and not isinstance(conversation_id, str):
        raise ApiError(400, "id must be a string")
    if not isinstance(all_, bool):
        raise ApiError(400, "all must be true or false")
    if (conversation_id is None) == (not all_):
        raise ApiError(400, 'name one conversation ("id") or ask for all ("all": true), not both')
    if conversation_id is not None:
        check_id(conversation_id)
    since_s: int | None = None
    if since is not None:
        if isinstance(since, bool) or not isinstance(since, str | int | float):
            raise ApiError(400, "since must be an ISO 8601 date or Unix seconds")
        since_s = int(parse_datetime("since", str(since)).timestamp())
    return RebuildRequest(conversation_id=conversation_id, all_=all_, since=since_s)
