"""A command the running daemon's control API does not know (a daemon started before an upgrade, still
running the version before) is refused with the advice to restart it, not only the API's own words."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from tenex_daemon.cli.client import ApiAccess
from tenex_daemon.cli.references import AccessError


@pytest.fixture
async def older_daemon() -> AsyncIterator[str]:
    """A control API of an older tenexd: it knows no ``id_prefix`` and no ``/stop`` route."""

    async def conversations(request: web.Request) -> web.Response:
        unknown = sorted(set(request.query) - {"archived", "limit"})
        if unknown:
            return web.json_response(
                {"error": f"unknown parameter(s): {', '.join(unknown)} (known: archived, limit)"}, status=400
            )
        return web.json_response({"conversations": []})

    app = web.Application()
    app.router.add_get("/api/v1/conversations", conversations)
    server = TestServer(app)
    await server.start_server()
    yield str(server.make_url("")).rstrip("/")
    await server.close()


async def test_a_parameter_or_route_an_older_daemon_does_not_know_says_to_restart_it(older_daemon: str) -> None:
    """An unknown parameter (400) and an unknown route (404) come back with the advice to restart the daemon;
    a request it knows is answered as before."""
    async with aiohttp.ClientSession() as session:
        access = ApiAccess(session, older_daemon)
        with pytest.raises(AccessError, match=r"unknown parameter\(s\): id_prefix .*older than this tenexd"):
            await access.search({"id_prefix": "2aca6cce"})
        with pytest.raises(AccessError, match=r"404: Not Found .*restart it"):
            await access._call("POST", "/conversations/ab/stop")
        assert await access.search({"limit": "1"}) == []
