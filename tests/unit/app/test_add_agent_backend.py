"""`agents add` without a backend gives the new agent the backend its peers (the orchestrator aside) share,
copied whole, and ``offline`` when they differ; a backend asked for wins."""

from __future__ import annotations

from pathlib import Path

from tenex_daemon.app.home import add_agent, init_home
from tenex_daemon.app.settings import BackendSettings, load_settings

OPENAI_BACKEND = """kind = "openai"
model = "gpt-4o-mini"
base_url = "http://127.0.0.1:9/v1"
api_key_env = "OPENAI_API_KEY"
temperature = 0.25
context_window = 128000
options = { max_tokens = 512, stop = ["\\n\\n"], extra = { "top-p" = 0.9, seed = 7 } }
"""


def give_agents_backend(home: Path, slugs: set[str], backend_toml: str) -> None:
    """Replace the ``[agents.backend]`` table of the agents ``slugs`` in the home's config.toml."""
    config = home / "config.toml"
    blocks = config.read_text().split("[[agents]]")
    for index, block in enumerate(blocks):
        if any(f'slug = "{slug}"' in block for slug in slugs):
            head, _, _ = block.partition("[agents.backend]")
            blocks[index] = f"{head}[agents.backend]\n{backend_toml}\n"
    config.write_text("[[agents]]".join(blocks))


def added_backend(home: Path, slug: str, backend_kind: str | None = None) -> BackendSettings:
    """Add agent ``slug`` and return the backend config.toml then gives it."""
    add_agent(load_settings(home, {}), slug, slug.title(), backend_kind=backend_kind)
    return next(a.backend for a in load_settings(home, {}).agents if a.slug == slug)


def test_an_agent_added_to_the_local_demo_home_gets_local(tmp_path: Path) -> None:
    """In `init --backend local`'s home (planner and executor local, the orchestrator offline) an added agent is local."""
    home = init_home(tmp_path / "h", backend="local").home
    assert added_backend(home, "reviewer").kind == "local"


def test_an_added_agent_copies_its_peers_whole_backend(tmp_path: Path) -> None:
    """When every agent but the orchestrator has the same openai backend, the added agent gets all of it: model, URL, options."""
    home = init_home(tmp_path / "h").home
    give_agents_backend(home, {"planner", "executor"}, OPENAI_BACKEND)
    shared = next(a.backend for a in load_settings(home, {}).agents if a.slug == "planner")
    assert shared.kind == "openai"
    assert added_backend(home, "reviewer") == shared


def test_peers_with_different_backends_give_offline_and_a_backend_asked_for_wins(tmp_path: Path) -> None:
    """Agents whose backends differ give an added agent ``offline``; ``backend_kind`` given is written as asked."""
    home = init_home(tmp_path / "h").home
    give_agents_backend(home, {"planner"}, OPENAI_BACKEND)
    assert added_backend(home, "reviewer") == BackendSettings()
    assert added_backend(home, "critic", backend_kind="local") == BackendSettings(kind="local")
