"""The control API's context preview has the persona a run sends, built from the daemon's own profiles, so the
preview and the run cannot drift apart."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from aiohttp.test_utils import TestClient, TestServer

from tenex_daemon import ConversationManager
from tenex_daemon.app.control_api import create_app
from tenex_daemon.app.metrics import Metrics
from tenex_daemon.app.wiring import Pipeline
from tenex_daemon.core.conversation import TitleSource
from tenex_daemon.services.answering import AgentProfile
from tenex_daemon.services.runs import RunRequest
from tenex_daemon.testing.fakes import ScriptedBackend
from tests import pipeline
from tests.conftest import Cast
from tests.unit.services.test_tool_loop import text

RECENT = "\n## Recent conversations\n- 2023-11-14 · Database: They chose PostgreSQL.\n"


@dataclass
class Target:
    """A ControlTarget; with ``pipeline`` set it also stands for a running daemon's pipeline."""

    manager: ConversationManager
    pipeline: Pipeline | None = None
    metrics: Metrics = field(default_factory=Metrics)

    def status(self) -> Mapping[str, Any]:
        """A fixed status."""
        return {"state": "running"}


async def preview_persona(target: Target, conversation_id: str) -> str:
    """GET the context preview for Alice; return its persona."""
    async with TestClient(TestServer(create_app(target))) as client:
        response = await client.get(f"/api/v1/conversations/{conversation_id}/context", params={"agent": "alice"})
        assert response.status == 200, await response.text()
        persona: str = (await response.json())["persona"]
        return persona


async def test_the_preview_persona_is_the_one_the_run_sends(cast: Cast) -> None:
    """With the daemon's profiles the preview's persona has Alice's instructions and the user's recent
    conversation, and it is exactly the system prompt her run then sends; without profiles only the name."""
    backend = ScriptedBackend([text("Hello.")])
    profiles = {a.slug: AgentProfile(a, "You answer briefly.", backend) for a in cast.agents}
    rig = pipeline.build_rig(cast, profiles=profiles)
    earlier = cast.user_says("Which database?", kind=11, tags=[["p", cast.alice.pubkey]])
    await rig.manager.create_conversation(earlier)
    await rig.manager.add_event(earlier.id, cast.alice_says("PostgreSQL.", tags=[["E", earlier.id]]))
    assert await rig.manager.end_conversation(earlier.id, by="idle")
    await rig.manager.describe(
        earlier.id, title="Database", summary="They chose PostgreSQL.", source=TitleSource.MODEL, for_activity=0
    )
    root = cast.user_says("Hi Alice", kind=11, tags=[["p", cast.alice.pubkey]])
    await rig.manager.create_conversation(root)

    previewed = await preview_persona(Target(rig.manager, rig.pipeline), root.id)
    bare = await preview_persona(Target(rig.manager), root.id)
    assert await rig.runner.run(RunRequest(root.id, root.id, "alice")) is not None
    await rig.runner.flush(5.0)

    assert previewed == "You are Alice.\nYou answer briefly.\n" + RECENT
    assert backend.requests[0].system_prompt == previewed
    assert bare == "You are Alice.\n" + RECENT
