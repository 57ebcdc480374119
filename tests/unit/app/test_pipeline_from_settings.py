"""A pipeline built the daemon's way (``PipelineOptions.from_settings``) follows the home's ``[phases]`` table."""

from __future__ import annotations

from pathlib import Path

import pytest

from tenex_daemon import MemoryStore
from tenex_daemon.adapters.llm.offline import OfflineBackend
from tenex_daemon.adapters.nostr.classifier import classify_event
from tenex_daemon.adapters.nostr.composer import SignedReplyComposer
from tenex_daemon.adapters.nostr.signer import Signer
from tenex_daemon.app.home import init_home
from tenex_daemon.app.settings import load_settings
from tenex_daemon.app.wiring import (
    PipelineOptions,
    PipelinePorts,
    build_agents,
    build_pipeline,
    load_signers,
)
from tenex_daemon.core.errors import PhaseTransitionError
from tenex_daemon.core.phases import Phase
from tenex_daemon.core.vocabulary import KIND_CONVERSATION_ROOT
from tenex_daemon.services.agent_runner import AgentProfile
from tenex_daemon.testing.fakes import FakePublisher

CUSTOM_PHASES = """
[phases]
chat = ["reflection"]
reflection = ["chat"]
"""


async def test_a_daemon_built_pipeline_uses_the_phases_of_config_toml(tmp_path: Path) -> None:
    """With ``[phases]`` allowing only chat -> reflection, the pipeline's manager allows that move (which the
    default table forbids) and refuses chat -> plan (which the default table allows)."""
    home = tmp_path / "h"
    init = init_home(home)
    with (home / "config.toml").open("a", encoding="utf-8") as config:
        config.write(CUSTOM_PHASES)
    settings = load_settings(home, {})
    signers, project = load_signers(settings)
    agents = build_agents(settings, signers)
    profiles = {a.slug: AgentProfile(a, "", OfflineBackend()) for a in agents}
    ports = PipelinePorts(
        store=MemoryStore(),
        composer=SignedReplyComposer(signers, None),
        publisher=FakePublisher(),
        classify=classify_event,
    )
    pipeline = build_pipeline(agents, profiles, ports, PipelineOptions.from_settings(settings, project.pubkey))
    assert init.owner.key_file is not None
    owner = Signer.from_file(init.owner.key_file)
    root = owner.sign(KIND_CONVERSATION_ROOT, "Look back on the week")
    manager = pipeline.manager
    await manager.create_conversation(root)

    with pytest.raises(PhaseTransitionError):
        await manager.update_phase(root.id, Phase.PLAN, "plan it", "planner")
    moved = await manager.update_phase(root.id, Phase.REFLECTION, "reflect", "planner")

    assert (moved.from_phase, moved.to_phase) == (Phase.CHAT, Phase.REFLECTION)
