"""The tools the runner says each agent is offered (what the kind-24010 heartbeat lists): its profile's,
plus ``send_message`` exactly when it may delegate."""

from __future__ import annotations

from tenex_daemon.services.answering import DEFAULT_TOOLS
from tenex_daemon.services.tools import SEND_MESSAGE
from tests.conftest import Cast
from tests.pipeline import build_rig


async def test_send_message_is_offered_to_agents_with_someone_to_ask(cast: Cast) -> None:
    """With two agents besides the orchestrator, each is offered its profile's tools and ``send_message``;
    the orchestrator only its profile's; an agent alone with the orchestrator has nobody to ask."""
    rig = build_rig(cast)
    alone = build_rig(cast, agents=[cast.alice, cast.orchestrator])

    try:
        runner = rig.pipeline.runner
        assert runner.offered_tools("alice") == (*DEFAULT_TOOLS, SEND_MESSAGE)
        assert runner.offered_tools("bob") == (*DEFAULT_TOOLS, SEND_MESSAGE)
        assert runner.offered_tools("orchestrator") == DEFAULT_TOOLS
        assert alone.pipeline.runner.offered_tools("alice") == DEFAULT_TOOLS
    finally:
        await rig.settle()
        await alone.settle()
