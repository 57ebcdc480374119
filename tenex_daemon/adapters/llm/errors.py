"""Turning what an SDK, an HTTP client or a command raised into a typed :class:`BackendError`."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any, TypeVar

from tenex_daemon.core.llm import (
    BackendError,
    BackendErrorKind,
    BackendUnavailableError,
    backend_error,
    mentions_context_too_long,
)

T = TypeVar("T")


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
    response = getattr(exc, "response", None)
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
        if code == "context_length_exceeded":
            kind = BackendErrorKind.CONTEXT_TOO_LONG
        return backend_error(
            kind, f"{backend}: HTTP {status}: {message}", retry_after=_retry_after(exc), status=status
        )
    return backend_error(BackendErrorKind.OTHER, f"{backend}: {type(exc).__name__}: {exc}")


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
        "connection was closed mid-answer, or the server sends none)",
    )


async def streamed_answer(seconds: float, backend: str, call: Awaitable[T]) -> T:
    """Await ``call`` (a streamed answer): a TIMEOUT BackendError when it is not whole within ``seconds``
    (the SDKs' timeout bounds each read, so a stream that keeps trickling never ends by itself), an
    UNREACHABLE one when the stream broke off; the SDK's own errors pass as they are."""
    try:
        async with asyncio.timeout(seconds):
            return await call
    except TimeoutError:
        raise backend_error(
            BackendErrorKind.TIMEOUT, f"{backend}: no whole answer within {seconds:g} s (the timeout option)"
        ) from None
    except Exception as exc:
        broken = _broken_stream(exc, backend)
        if broken is None:
            raise
        raise broken from exc
