"""What a backend's failure or cut answer becomes: the error text redacted wherever it is published or
logged (an agent's error reply, the orchestrator's log), and an answer the provider's filter cut said so."""

from __future__ import annotations

import pytest
from structlog.testing import capture_logs

from tenex_daemon.core.llm import BackendError, CompletionRequest, CompletionResult
from tenex_daemon.services.runs import RunRequest
from tenex_daemon.testing.fakes import RecordingRouting, ScriptedBackend
from tests import pipeline
from tests.conftest import Cast
from tests.unit.services import test_orchestration, test_tool_loop

KEY_SHAPES = [
    "gsk_AbCdEf0123456789AbCdEf0123456789",
    "xai-AbCdEf0123456789AbCdEf0123456789",
    "hf_AbCdEfGhIjKlMnOpQrStUvWxYz012345",
    "AIzaSyA-1234567890abcdefghijklmnopqrstu",
    "github_pat_11ABCDEFG0123456789abcdef",
]


class RefusingBackend:
    """An agent's backend that fails with ``said``, the provider's text, as an auth error."""

    name = "openai"

    def __init__(self, said: str) -> None:
        self.said = said

    async def complete(self, request: CompletionRequest) -> CompletionResult:
        """Fail as the provider did."""
        raise BackendError("auth", self.said)


async def published(cast: Cast, said: str) -> str:
    """What the agent's error reply shows of the provider's text ``said``."""
    base = pipeline.build_rig(cast, backend=RefusingBackend(said), composer=pipeline.real_composer(cast))
    root = cast.user_says("Hello Alice", kind=11, tags=[["p", cast.alice.pubkey]])
    await base.manager.create_conversation(root)
    reply = await base.runner.run(RunRequest(root.id, root.id, "alice"), RecordingRouting())
    assert reply is not None
    assert reply.has_tag("error", "system")
    prefix = "I could not answer: the openai backend failed (auth): "
    assert reply.content.startswith(prefix)
    return reply.content.removeprefix(prefix)


@pytest.mark.parametrize("key", KEY_SHAPES)
async def test_keys_of_other_providers_shapes_are_redacted(cast: Cast, key: str) -> None:
    """A Groq, xAI, Hugging Face, Google or GitHub key a provider's error shows is left out of the agent's
    (maybe public) error reply."""
    assert await published(cast, f"openai: HTTP 401: invalid key {key}.") == "openai: HTTP 401: invalid key <redacted>."


@pytest.mark.parametrize(
    ("said", "shown"),
    [
        ("invalid credentials: Bearer 3f9a1c0d2b7e4f6a8c9d", "invalid credentials: Bearer <redacted>"),
        ("bearer eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOjF9.abc", "bearer <redacted>"),
        ('header x-api-key: "abcd1234efgh"', 'header x-api-key: "<redacted>"'),
        ("query api_key=abcd1234efgh&x=1", "query api_key=<redacted>&x=1"),
        ("GET /v1?api_key=abc12345/models", "GET /v1?api_key=<redacted>/models"),
        ("Bearer abcdefgh/ijkl5678mnop", "Bearer <redacted>"),
        ("Bearer wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY rejected", "Bearer <redacted> rejected"),
        ("token Bearer abcdefghijklmnopqrstuvwx and", "token Bearer <redacted> and"),  # letters alone, long
        ("api_key=ZzzzYyyyXxxxWwwwVvvv", "api_key=<redacted>"),  # letters of both cases
    ],
)
async def test_a_token_after_bearer_or_api_key_is_redacted_and_its_label_kept(
    cast: Cast, said: str, shown: str
) -> None:
    """A token a server echoes after ``Bearer`` or ``api_key``, whatever its shape, is left out of the error
    reply, the label kept."""
    assert await published(cast, said) == shown


@pytest.mark.parametrize(
    "said",
    [
        "the bearer of bad news",
        "Bearer token missing",
        "a key-value store",
        "hf_hub is down",
        "the xai-grok model",
        "org-wide quota",
        "Bearer realm=api",
        "api_key=missing",
        "unknown argument key_name_2",
        "sess_id_123 is not set",
        "hf_hub_download_v2 failed",
        "model pplx-70b-online not found",
        "bearer 12345678",
        "expected Bearer authentication/authorization header",
        "Bearer error=invalid_token,error_description=expired",
        "Invalid api_key: please_check_your_configuration",
        "x-api-key: header_is_missing_or_invalid",
        "Expected bearer misconfiguration.",
        "model gpt-4o-2024-08-06 overloaded",
        "event " + "ab" * 32 + " by npub1sn0wdenkukak0d9dfczzeacvhkrgz92ak56egt7vdgzn8pv2wfqqhrjdv9",
    ],
)
async def test_ordinary_words_are_not_redacted(cast: Cast, said: str) -> None:
    """Words that merely look like a key's beginning (no digit, short; a code or model name, a number, an
    event id or npub) are kept in the error reply."""
    assert await published(cast, said) == said


async def test_an_answer_the_providers_filter_cut_says_so(cast: Cast) -> None:
    """An answer that ended with finish reason content_filter is published with a note saying the
    provider's filter cut it (it was published as if whole)."""
    cut = CompletionResult(text="The plan is ", finish_reason="content_filter")
    rig = test_tool_loop.make_rig(cast, ScriptedBackend([cut]))
    root = await test_tool_loop.start(rig, cast)

    reply = await test_tool_loop.run(rig, root)

    assert reply.content == "The plan is\n\n[Cut off: the provider's content filter stopped this answer.]"
    assert not reply.has_tag("error", "system")


class EchoingBackend:
    """A routing model whose provider refuses the key and echoes it."""

    name = "openai"

    async def complete(self, request: CompletionRequest) -> CompletionResult:
        """Fail as OpenAI's 401 does when a proxy echoes the header."""
        raise BackendError("auth", "openai: HTTP 401: invalid credentials: Bearer sk-proj-SECRETabc1234567890XYZ")


async def test_the_orchestrators_log_of_a_failed_backend_shows_no_piece_of_a_key(cast: Cast) -> None:
    """The orchestrator's ``orchestrator_backend_failed`` line logs the provider's text redacted as an agent's
    error reply is (it logged the key)."""
    rig = test_orchestration.make_rig(cast, EchoingBackend())
    with capture_logs() as logs:
        await rig.dispatcher.handle(cast.user_says("Please @bob look", kind=11))
        await test_orchestration.settle(rig)

    failed = [entry for entry in logs if entry["event"] == "orchestrator_backend_failed"]
    assert failed
    assert all("SECRETabc" not in str(entry) for entry in failed)
    assert failed[0]["detail"] == "openai: HTTP 401: invalid credentials: Bearer <redacted>"


class FailingAs:
    """An agent's backend that fails with one kind of error."""

    name = "openai"

    def __init__(self, kind: str) -> None:
        self.kind = kind

    async def complete(self, request: CompletionRequest) -> CompletionResult:
        """Fail so."""
        raise BackendError(self.kind, f"openai: failed as {self.kind}")


@pytest.mark.parametrize(
    ("kind", "advice"),
    [
        ("context_too_long", "backend.context_window"),
        ("rate_limit", "limits the calls"),
        ("timeout", "options.timeout"),
        ("auth", "check the backend settings (base_url, api_key_env, model)"),
    ],
)
async def test_the_operator_is_told_what_to_do_by_the_kind_of_failure(cast: Cast, kind: str, advice: str) -> None:
    """The log of a backend's failure says what the operator can do for that kind of failure: the model's
    window for a context too long, not the settings' base_url and key, which are checked otherwise."""
    base = pipeline.build_rig(cast, backend=FailingAs(kind), composer=pipeline.real_composer(cast))
    root = cast.user_says("Hello Alice", kind=11, tags=[["p", cast.alice.pubkey]])
    await base.manager.create_conversation(root)
    with capture_logs() as logs:
        await base.runner.run(RunRequest(root.id, root.id, "alice"), RecordingRouting())

    [failed] = [entry for entry in logs if entry["event"] == "backend_failed"]
    assert advice in failed["action"]
