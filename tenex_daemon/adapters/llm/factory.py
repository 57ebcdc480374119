"""Choosing a backend by name: offline, openai, anthropic, claude-code, local.

Each backend's module is imported only when chosen, so a missing optional extra matters only to the
agents configured with that backend (and the error names the extra to install).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

from tenex_daemon.core.llm import LLMBackend

BACKEND_NAMES = ("offline", "openai", "anthropic", "claude-code", "local")


class UnknownBackendError(ValueError):
    """The configured backend name is not one of :data:`BACKEND_NAMES`."""


def make_backend(
    kind: str,
    *,
    model: str | None = None,
    base_url: str | None = None,
    api_key_env: str | None = None,
    api_key_file: str | None = None,
    temperature: float | None = None,
    options: Mapping[str, Any] | None = None,
    home: Path | None = None,
    run_dir: Path | None = None,
    store_path: Path | None = None,
    withheld_keys: Collection[str] = (),
    withheld_files: Collection[Path] = (),
) -> LLMBackend:
    """Build the backend named ``kind``; ``options`` are passed on as that backend's keyword arguments.

    ``model`` is the model name (openai, anthropic, claude-code) or a GGUF file path (local; None for the
    bundled SmolLM2-135M-Instruct). Options by backend: openai ``timeout``, ``max_retries``, ``max_tokens``,
    ``stream_usage``, ``extra_body``; anthropic ``timeout``, ``max_retries``, ``max_tokens``; claude-code
    ``command``, ``timeout``, ``cwd``, ``partial_messages``, ``extra_args``, ``env``; local ``n_ctx``,
    ``n_threads``, ``max_tokens``, ``chat_format``, ``repeat_penalty``.

    ``home`` (the daemon's home), ``run_dir`` (its run folder) and ``store_path`` (its store's conversations)
    matter to claude-code only, which runs a command that must be kept out of them (the keys, the
    conversations) and records its processes in the run folder; the daemon passes them. ``withheld_keys``
    and ``withheld_files`` (claude-code too): the variables and files the daemon's backends read their keys
    from (``api_key_env``, ``api_key_file``), kept out of ``claude``'s environment and file tools.
    """
    extra = dict(options or {})
    if kind == "offline":
        from tenex_daemon.adapters.llm.offline import OfflineBackend

        return OfflineBackend()
    if kind == "openai":
        from tenex_daemon.adapters.llm.openai import OpenAIBackend

        if model is None:
            raise UnknownBackendError("the openai backend needs a model name")
        return OpenAIBackend(
            model=model,
            base_url=base_url,
            api_key_env=api_key_env,
            api_key_file=api_key_file,
            temperature=temperature,
            **extra,
        )
    if kind == "anthropic":
        from tenex_daemon.adapters.llm.anthropic import AnthropicBackend

        if model is not None:
            extra["model"] = model
        return AnthropicBackend(
            base_url=base_url,
            api_key_env=api_key_env,
            api_key_file=api_key_file,
            temperature=temperature,
            **extra,
        )
    if kind == "claude-code":
        from tenex_daemon.adapters.llm.claude_code import ClaudeCodeBackend

        return ClaudeCodeBackend(
            model=model,
            home=home,
            run_dir=run_dir,
            store_path=store_path,
            withheld_keys=withheld_keys,
            withheld_files=withheld_files,
            **extra,
        )
    if kind == "local":
        from tenex_daemon.adapters.llm.local import LocalBackend

        return LocalBackend(model=model, temperature=temperature, **extra)
    raise UnknownBackendError(f"unknown backend {kind!r} (available: {', '.join(BACKEND_NAMES)})")
