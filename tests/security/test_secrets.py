"""Secrets never leave their files: after a real conversation with every path a secret could slip through
(debug logs, a delegation, orchestrator routing, a model error, the TCP control API with its token and a
refused request), no file the daemon wrote, no event it published and no request it sent to the model holds
any key it holds, in any form."""

from __future__ import annotations

import base64
import json
import os
import stat
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from tenex_daemon.adapters.nostr.signer import Signer
from tenex_daemon.core import nip19
from tests.e2e.harness import Home, set_agent_backend
from tests.evidence import record
from tests.integration.nostr.harness import LocalRelayServer, free_port
from tests.llm_servers import openai_answer
from tests.security.conftest import (
    log_records,
    make_home,
    publish,
    query,
    replies_to,
    running,
    signed,
    wait_for_events,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

API_KEY_NAME = "model-api.key"


@dataclass
class ScriptedModel:
    """An OpenAI-compatible server answering each chat completion with the next scripted (status, body),
    then ``fallback``; it records every request's headers and body (what the daemon sent a model)."""

    url: str = ""
    script: list[tuple[int, dict[str, Any]]] = field(default_factory=list)
    fallback: dict[str, Any] = field(default_factory=lambda: openai_answer("Fine."))
    requests: list[tuple[dict[str, str], bytes]] = field(default_factory=list)

    async def handle(self, request: web.Request) -> web.Response:
        """Record the request and answer the next scripted reply."""
        self.requests.append((dict(request.headers), await request.read()))
        status, body = self.script.pop(0) if self.script else (200, self.fallback)
        return web.json_response(body, status=status)


@pytest.fixture
async def model() -> AsyncIterator[ScriptedModel]:
    """A scripted model on a free local port."""
    server = ScriptedModel()
    app = web.Application()
    app.router.add_post("/v1/chat/completions", server.handle)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    server.url = f"http://127.0.0.1:{port}/v1"
    yield server
    await runner.cleanup()


def tool_call(name: str, arguments: dict[str, str]) -> dict[str, Any]:
    """An OpenAI chat completion calling one tool."""
    call = {"id": "call_1", "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}
    return {
        "id": "chatcmpl-t", "object": "chat.completion", "created": 0, "model": "scripted",
        "choices": [{"index": 0, "finish_reason": "tool_calls",
                     "message": {"role": "assistant", "content": None, "tool_calls": [call]}}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7},
    }


@dataclass(frozen=True)
class Secret:
    """A secret the daemon holds: a name for messages (never its value) and the forms it could leak in."""

    name: str
    forms: tuple[tuple[str, bytes], ...]


def key_forms(name: str, secret_hex: str) -> Secret:
    """A Nostr secret key as hex (both cases), nsec (both cases), raw 32 bytes and base64 (both alphabets,
    padded or not)."""
    raw = bytes.fromhex(secret_hex)
    nsec = nip19.encode_nsec(secret_hex)
    b64, b64url = base64.b64encode(raw).decode(), base64.urlsafe_b64encode(raw).decode()
    forms = {
        "hex": secret_hex.lower(), "HEX": secret_hex.upper(), "nsec": nsec, "NSEC": nsec.upper(),
        "base64": b64, "base64-unpadded": b64.rstrip("="), "base64url": b64url,
        "base64url-unpadded": b64url.rstrip("="),
    }
    return Secret(name, (*((k, v.encode()) for k, v in forms.items()), ("raw", raw)))


def text_forms(name: str, value: str) -> Secret:
    """A text secret (a token, an API key) as written, and in base64."""
    return Secret(name, (("text", value.encode()), ("base64", base64.b64encode(value.encode()))))


def files_under(*roots: Path, skip: frozenset[Path]) -> Iterator[Path]:
    """Every regular file under ``roots`` but ``skip`` (the secrets' own files)."""
    for root in roots:
        for path in sorted(root.rglob("*")):
            if path.is_file() and not path.is_symlink() and path.resolve() not in skip:
                yield path


async def converse_through_every_path(home: Home, relay: LocalRelayServer, model: ScriptedModel, port: int) -> None:
    """Owner messages that delegate, are routed by the orchestrator and meet a model error; the TCP control
    API asked with the token, and refused without it."""
    owner, planner, executor = Signer.from_text(home.owner_secret), home.agent("planner"), home.agent("executor")
    model.script = [
        (200, tool_call("send_message", {"to": "executor", "message": "Is the venue free on Friday?"})),
        (200, openai_answer("The venue is free: here is the plan.")),
    ]
    first = signed(owner, 11, "Plan the offsite", [["p", planner]])
    await publish(relay.url, [first])
    await wait_for_events(relay.url, replies_to(first["id"], [planner]), 1)
    delegation = await query(relay.url, [{"kinds": [1111], "#E": [first["id"]], "authors": [executor]}])
    assert delegation, "the executor answered the delegation"

    model.script = [(200, openai_answer("Routed here by the orchestrator."))]
    routed = signed(owner, 11, "Whoever is free: book the room", [["p", home.project]])
    await publish(relay.url, [routed])
    await wait_for_events(relay.url, replies_to(routed["id"], [planner]), 1)

    model.script = [(500, {"error": {"message": "the model server broke"}})]
    thread = [["E", first["id"], "", owner.pubkey], ["K", "11"], ["P", owner.pubkey],
              ["e", first["id"], "", owner.pubkey], ["k", "11"], ["p", planner]]
    earlier = await query(relay.url, replies_to(first["id"], [planner]))
    await publish(relay.url, [signed(owner, 1111, "And the catering?", thread)])
    replies = await wait_for_events(relay.url, replies_to(first["id"], [planner]), len(earlier) + 1)
    assert any(["error", "system"] in r["tags"] for r in replies), "the model error was answered as one"

    token = (home.path / "run" / "control.token").read_text().strip()
    base = f"http://127.0.0.1:{port}"
    async with aiohttp.ClientSession() as session:
        for path in ("/api/v1/status", "/api/v1/conversations", f"/api/v1/conversations/{first['id']}", "/metrics"):
            async with session.get(base + path, headers={"Authorization": f"Bearer {token}"}) as answer:
                assert answer.status == 200, path
        async with session.get(base + "/api/v1/status", headers={"Authorization": f"Bearer {token[::-1]}"}) as bad:
            assert bad.status == 401
        async with session.get(base + "/api/v1/status", headers={"Authorization": f"Bearer {token}",
                                                                   "Origin": "http://evil.example"}) as cross:
            assert cross.status == 403


async def test_no_file_event_or_model_request_holds_a_secret(
    relay: LocalRelayServer, model: ScriptedModel, tmp_path: Path
) -> None:
    """Every key the daemon holds (agent, project and owner keys, the control token, the model's API key) is
    absent, in every form (hex, nsec, raw, base64), from every file it wrote (logs at debug level, the store,
    status, temporary files), from every event it published and every request it sent to the model; the key
    files are mode 0600 in a 0700 folder and the token file 0600."""
    home = make_home(tmp_path / "home", [relay.url])
    api_key = "sk-test-" + os.urandom(24).hex()
    api_key_file = home.path / "keys" / API_KEY_NAME
    api_key_file.write_text(api_key + "\n")
    api_key_file.chmod(0o600)
    set_agent_backend(home, "planner", f"""
kind = "openai"
model = "scripted"
base_url = "{model.url}"
api_key_file = "{api_key_file}"
options = {{ timeout = 10, max_retries = 0 }}
""")
    port = free_port()
    daemon_tmp = tmp_path / "daemon-tmp"
    daemon_tmp.mkdir()
    env = {
        "TENEX_DAEMON__LOG_LEVEL": "debug",
        "TENEX_DAEMON__STREAM_PARTIALS": "false",
        "TENEX_CONTROL__TCP_PORT": str(port),
        "TMPDIR": str(daemon_tmp),
    }
    async with running(home, env):
        await converse_through_every_path(home, relay, model, port)
    assert any(r.get("level") == "debug" for r in log_records(home)), "the daemon logged at debug level"

    token_file = home.path / "run" / "control.token"
    key_files = sorted((home.path / "keys").glob("*.key"))
    assert {p.name for p in key_files} >= {"owner.key", "project.key", "orchestrator.key", "planner.key",
                                          "executor.key", API_KEY_NAME}
    for path in (*key_files, token_file):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, f"{path.name} is {oct(path.stat().st_mode)}"
    assert stat.S_IMODE((home.path / "keys").stat().st_mode) == 0o700

    secrets = [key_forms(p.stem, Signer.from_file(p).secret_hex()) for p in key_files if p.name != API_KEY_NAME]
    secrets += [text_forms("control token", token_file.read_text().strip()), text_forms("model API key", api_key)]
    skip = frozenset(p.resolve() for p in (*key_files, token_file))
    scanned = list(files_under(home.path, daemon_tmp, skip=skip))
    published = await query(relay.url, [{"limit": 100_000}])
    sources: list[tuple[str, bytes]] = [(str(p.relative_to(tmp_path)), p.read_bytes()) for p in scanned]
    sources += [(f"published event {e['id']} (kind {e['kind']})", json.dumps(e).encode()) for e in published]
    sources += [(f"model request {i}", body) for i, (_, body) in enumerate(model.requests)]

    leaks = [(where, secret.name, form) for where, data in sources for secret in secrets
             for form, value in secret.forms if value in data]
    assert leaks == [], f"secrets found (where, whose, form; never the value): {leaks}"
    assert len(model.requests) >= 4, "the model was asked (delegation, its answer, the routed turn, the error)"
    assert any(f"Bearer {api_key}" == h.get("Authorization") for h, _ in model.requests), "the key was used"
    record(
        "security.secrets", files_scanned=len(scanned), bytes_scanned=sum(len(d) for _, d in sources),
        published_events_scanned=len(published), model_requests_scanned=len(model.requests),
        secrets=len(secrets), forms=sum(len(s.forms) for s in secrets), leaks=len(leaks),
    )
