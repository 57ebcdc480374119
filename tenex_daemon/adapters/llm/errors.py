"""Turning what an SDK, an HTTP client or a command raised into a typed :class:`BackendError`."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Iterable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, TypeVar

from tenex_daemon.core.llm import (
    BackendError,
    BackendErrorKind,
    BackendUnavailableError,
    backend_error,
    mentions_context_too_long,
)

T = TypeVar("T")

ERROR_DETAIL_CHARS = 1024
"""How much of a provider's or a command's own words an error keeps: a 2 MB error body or 5 MB of stderr is
no error reply (the head of a message is kept, the tail of a command's stderr, where its last words are)."""
ERROR_TEXT_CHARS = ERROR_DETAIL_CHARS + 256
"""The most an error's whole text holds: the detail and what frames it (``openai: HTTP 500: ...``)."""
MIN_SECRET_CHARS = 8
"""A backend's key shorter than this is not looked for in error text (``no-key``, a test's ``k``)."""
REDACTED = "<redacted>"
"""What stands for a key left out of an error's text (the error reply's redaction writes the same)."""


class MissingExtraError(BackendUnavailableError, ImportError):
    """A backend's optional dependency is not installed; the message names the extra to install."""

    def __init__(self, backend: str, extra: str, module: str) -> None:
        super().__init__(
            message=(
                f"the {backend} backend needs the Python package {module!r}, which is not installed: "
                f"pip install 'tenexd[{extra}]' (or, in a checkout: uv sync --extra {extra})"
            )
        )
        self.extra = extra


def kind_for_status(status: int, message: str) -> BackendErrorKind:
    """The error kind an HTTP status (and the provider's message) means."""
    if status in (401, 403):
        return BackendErrorKind.AUTH
    if status == 429:
        return BackendErrorKind.RATE_LIMIT
    if status == 413 or (status in (400, 422) and mentions_context_too_long(message)):
        return BackendErrorKind.CONTEXT_TOO_LONG
    if status in (408, 504):
        return BackendErrorKind.TIMEOUT
    if status in (400, 404, 422):
        return BackendErrorKind.BAD_REQUEST
    if status in (502, 503, 529):
        return BackendErrorKind.UNREACHABLE
    return BackendErrorKind.OTHER


def _retry_after(exc: Any) -> float | None:
    return _retry_after_of(getattr(exc, "response", None))


def _retry_after_of(response: Any) -> float | None:
    """The seconds an HTTP answer's ``Retry-After`` asks to wait, when it says."""
    headers = getattr(response, "headers", None)
    if headers is None:
        return None
    value = headers.get("retry-after")
    try:
        return float(value) if value is not None else None
    except (TypeError, ValueError):
        return None


def _provider_message(exc: Any) -> str:
    """The provider's own error text when the body carries one, else the exception's message."""
    body = getattr(exc, "body", None)
    if isinstance(body, dict):
        inner = body.get("error", body)
        if isinstance(inner, dict) and isinstance(inner.get("message"), str):
            return str(inner["message"])
        if isinstance(body.get("message"), str):
            return str(body["message"])
    return str(exc) or type(exc).__name__


def trimmed(text: str, limit: int = ERROR_DETAIL_CHARS, *, tail: bool = False) -> str:
    """``text`` cut to ``limit`` characters, saying so: its head (and how many characters were left out), or
    its ``tail`` (what came before it may have been dropped already, uncounted)."""
    if len(text) <= limit:
        return text
    if tail:
        return f"[earlier text left out] {text[-limit:]}"
    return f"{text[:limit]} [{len(text) - limit} more characters left out]"


def without_secrets(text: str, secrets: Iterable[str | None]) -> str:
    """``text`` with each of ``secrets`` (a backend's own key) replaced, whatever its shape: a server that
    echoes the key it was sent (``invalid credentials: Bearer <key>``) does not publish it."""
    for secret in secrets:
        if secret and len(secret) >= MIN_SECRET_CHARS and secret in text:
            text = text.replace(secret, REDACTED)
    return text


def map_sdk_error(exc: Exception, sdk: Any, backend: str) -> BackendError:
    """Map an exception of the ``openai`` or ``anthropic`` SDK (``sdk`` is the module) to a BackendError.

    Both SDKs share one hierarchy: ``APITimeoutError`` < ``APIConnectionError`` < ``APIError``, and
    ``APIStatusError`` with ``status_code`` for every HTTP error answer.
    """
    if isinstance(exc, sdk.APITimeoutError):
        return backend_error(BackendErrorKind.TIMEOUT, f"{backend}: the request timed out")
    if isinstance(exc, sdk.APIConnectionError):
        cause = exc.__cause__ or exc.__context__
        detail = f" ({type(cause).__name__}: {cause})" if cause is not None else ""
        return backend_error(BackendErrorKind.UNREACHABLE, f"{backend}: cannot connect{detail}")
    if isinstance(exc, sdk.APIStatusError):
        status = int(exc.status_code)
        message = _provider_message(exc)
        code = getattr(exc, "code", None)
        kind = kind_for_status(status, message)
        if code == "context_length_exceeded" or getattr(exc, "type", None) == "exceed_context_size_error":
            kind = BackendErrorKind.CONTEXT_TOO_LONG  # OpenAI's code; llama.cpp's server's type
        return backend_error(
            kind, f"{backend}: HTTP {status}: {message}", retry_after=_retry_after(exc), status=status
        )
    # an error without a status: one a stream sent in place of its next piece (the answer was under way)
    said = f"{backend}: {type(exc).__name__}: {exc}"
    kind = BackendErrorKind.CONTEXT_TOO_LONG if mentions_context_too_long(said) else BackendErrorKind.OTHER
    return backend_error(kind, said)


def _error_said(answer: Any) -> tuple[str, int | None] | None:
    """The provider's error message (and its numeric code) in an answer that carries one instead of a
    completion (a proxy's HTTP 200 with ``{"error": {...}}``), else None."""
    error = answer.get("error") if isinstance(answer, dict) else getattr(answer, "error", None)
    if isinstance(error, str) and error.strip():
        return error, None
    if not isinstance(error, dict) or not isinstance(error.get("message"), str):
        return None
    code = error.get("code")
    return error["message"], code if isinstance(code, int) and not isinstance(code, bool) else None


def malformed_answer(backend: str, what: str, answer: Any = None) -> BackendError:
    """The error for an answer that is no completion (``what`` says why): the provider's own error message
    when it carries one (of the kind its numeric code names, if any), else the kind OTHER."""
    said = _error_said(answer)
    kind = BackendErrorKind.OTHER
    if said is not None:
        message, code = said
        if code is not None and 400 <= code < 600:
            kind = kind_for_status(code, message)
        elif mentions_context_too_long(message):
            kind = BackendErrorKind.CONTEXT_TOO_LONG
        return backend_error(kind, f"{backend}: malformed answer: {what}; the provider said: {message}")
    if isinstance(answer, str | bytes) and answer.strip():
        head = answer[: 4 * ERROR_TEXT_CHARS]  # (:func:`cleaned` trims the error's text further)
        what = f"{what}: {head if isinstance(head, str) else head.decode('utf-8', errors='replace')!r}"
    return backend_error(kind, f"{backend}: malformed answer: {what}")


def failure(
    exc: Exception, backend: str, sdk: Any, sdk_error: type[Exception], secrets: Iterable[str | None] = ()
) -> Exception:
    """What ``exc``, out of a call to an SDK backend, is raised as: a BackendError (the SDK's errors and an
    answer that is not JSON or not UTF-8 mapped to one) whose text is trimmed to :data:`ERROR_TEXT_CHARS`
    and holds none of ``secrets`` (:func:`cleaned`); any other exception is returned as it is."""
    if isinstance(exc, BackendError):
        error = exc
    elif isinstance(exc, sdk_error):
        error = map_sdk_error(exc, sdk, backend)
    elif isinstance(exc, json.JSONDecodeError | UnicodeDecodeError):
        error = malformed_answer(backend, f"{type(exc).__name__}: {exc}")
    else:
        return exc
    return cleaned(error, secrets)


def cleaned(error: BackendError, secrets: Iterable[str | None] = ()) -> BackendError:
    """``error`` with none of ``secrets`` in its text, trimmed to :data:`ERROR_TEXT_CHARS` (the secrets
    are replaced first, so no piece of one is left at the cut); ``error`` itself when that changes nothing."""
    text = str(error)
    tidy = trimmed(without_secrets(text, secrets), ERROR_TEXT_CHARS)
    if tidy == text:
        return error
    return backend_error(error.kind, tidy, retry_after=error.retry_after, status=error.status)


def _broken_stream(exc: Exception, backend: str) -> BackendError | None:
    """A failure of the HTTP library under an SDK while an answer streams (the connection cut mid-way: it
    comes out of the iteration unwrapped), as a BackendError; None for anything else."""
    if type(exc).__module__.split(".")[0] in ("httpx", "httpx2", "httpcore", "h11", "aiohttp"):
        detail = f"{backend}: the answer's stream broke off ({exc!r})"
        return backend_error(BackendErrorKind.UNREACHABLE, detail)
    return None


def unfinished_stream(backend: str) -> BackendError:
    """The error for a streamed answer that ended without the model's finish marker (a proxy or the
    server closed it cleanly mid-answer): what came may be cut anywhere, so it is not an answer."""
    return backend_error(
        BackendErrorKind.UNREACHABLE,
        f"{backend}: the answer's stream ended before the model finished it (no finish reason came: the "
        "connection was closed mid-answer, the server sends none, or it cut this answer for another "
        "request, as llama.cpp's server does unless started with --interrupt_requests False)",
    )


@dataclass(frozen=True, slots=True)
class _Refusal:
    """An HTTP error answer the SDK tried again after: its status, its words, the wait it asked for."""

    status: int
    message: str
    retry_after: float | None

    def error(self, backend: str, seconds: float) -> BackendError:
        """The error to report when the call's time ran out while the SDK was trying again."""
        return backend_error(
            kind_for_status(self.status, self.message),
            f"{backend}: HTTP {self.status}: {self.message} (still so when the timeout option's "
            f"{seconds:g} s were spent)",
            retry_after=self.retry_after,
            status=self.status,
        )


_REFUSALS: ContextVar[list[_Refusal] | None] = ContextVar("tenex_llm_refusals", default=None)
"""The HTTP error answers of the call under way in this task (:func:`answer_within` sets it)."""


def _message_in_body(body: bytes, status: int) -> str:
    """The provider's error message in an error answer's body (its JSON ``error.message``), else the body."""
    text = body.decode("utf-8", errors="replace").strip()
    try:
        parsed = json.loads(text)
    except ValueError:
        parsed = None
    said = _error_said(parsed)
    if said is None and isinstance(parsed, dict) and isinstance(parsed.get("message"), str):
        said = (parsed["message"], None)
    return said[0] if said is not None else text or f"Error code: {status}"


async def note_refusal(response: Any) -> None:
    """An HTTP client's response hook: remember an error answer (4xx, 5xx) of the call under way, so a call
    whose time runs out while the SDK waits to try again (a 429's Retry-After) reports that answer, not a
    timeout; an answer that is no error forgets them (the SDK's try again got through). Its body is read
    here (httpx keeps it for the SDK); one that cannot be read leaves the status alone to say it."""
    refusals = _REFUSALS.get()
    status = int(getattr(response, "status_code", 0))
    if refusals is None:
        return
    if status < 400:  # answered: a time that runs out later is the answer's own (a stream too slow)
        refusals.clear()
        return
    try:
        message = _message_in_body(await response.aread(), status)
    except Exception:  # a body cut short, a broken encoding: the status still says what happened
        message = f"Error code: {status}"
    refusals.append(_Refusal(status, message, _retry_after_of(response)))


async def answer_within(seconds: float, backend: str, call: Awaitable[T]) -> T:
    """Await ``call`` (one answer, with the SDK's tries again): a TIMEOUT BackendError when it is not whole
    within ``seconds`` (the SDKs' timeout bounds each read, so a server that keeps trickling never ends by
    itself), or, when the SDK was trying again after an HTTP error answer (:func:`note_refusal`), that
    answer's error; an UNREACHABLE one when a stream broke off; the SDK's own errors pass as they are."""
    refusals: list[_Refusal] = []
    token = _REFUSALS.set(refusals)
    try:
        async with asyncio.timeout(seconds):
            return await call
    except TimeoutError:
        if refusals:
            raise refusals[-1].error(backend, seconds) from None
        raise backend_error(
            BackendErrorKind.TIMEOUT, f"{backend}: no whole answer within {seconds:g} s (the timeout option)"
        ) from None
    except Exception as exc:
        broken = _broken_stream(exc, backend)
        if broken is None:
            raise
        raise broken from exc
    finally:
        _REFUSALS.reset(token)


async def sdk_answer(
    call: Awaitable[T],
    *,
    streamed: bool,
    read_timeout: float,
    max_retries: int,
    backend: str,
    sdk: Any,
    sdk_error: type[Exception],
    secrets: Iterable[str | None] = (),
) -> T:
    """Await one answer of an SDK backend (``openai``, ``anthropic``): bounded whole, a streamed one by
    ``read_timeout`` (the SDK's, which bounds each read only), one that does not stream by
    ``read_timeout * (max_retries + 1)`` (once for each try the SDK makes); its failures raised as
    :func:`failure` says."""
    seconds = read_timeout if streamed else read_timeout * (max_retries + 1)
    try:
        return await answer_within(seconds, backend, call)
    except Exception as exc:
        error = failure(exc, backend, sdk, sdk_error, secrets)
        if error is exc:
            raise
        raise error from exc
