"""What ``nostr:`` references and article tags point at, fetched for an agent's view (docs/CONTEXT.md).

A resolver (the relay pool's, in the daemon) finds the events; here they are cached, cut at a timeout
and checked: a reference slower than the timeout, or whose event's id does not match its content,
stays as written.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Sequence

import structlog

from tenex_daemon.core import nip19
from tenex_daemon.core.conversation import ReferencedArticle
from tenex_daemon.core.events import NostrEvent
from tenex_daemon.core.ports import EventResolver
from tenex_daemon.core.vocabulary import KIND_ARTICLE, TAG_ADDRESS, TAG_TITLE

log = structlog.get_logger(__name__)

DEFAULT_RESOLVE_TIMEOUT_S = 2.0
RESOLVED_CACHE_SIZE = 1024


class References:
    """Resolves references through ``resolver`` (None: every reference stays as written), each within
    ``timeout`` seconds; the contents found are cached (the newest ``RESOLVED_CACHE_SIZE``)."""

    def __init__(self, resolver: EventResolver | None, timeout: float = DEFAULT_RESOLVE_TIMEOUT_S) -> None:
        self._resolver = resolver
        self._timeout = timeout
        self._resolved: OrderedDict[str, str] = OrderedDict()

    async def contents(self, uris: Sequence[str]) -> dict[str, str]:
        """The content of each ``nostr:`` URI found (cached); the others are left out."""
        if not uris:
            return {}
        resolved = {uri: self._resolved[uri] for uri in uris if uri in self._resolved}
        pending = [uri for uri in uris if uri not in resolved]
        if not pending or self._resolver is None:
            return resolved
        results = await asyncio.gather(*(self._content(uri) for uri in pending))
        for uri, content in zip(pending, results, strict=True):
            if content is not None:
                resolved[uri] = content
                self._resolved[uri] = content
                self._resolved.move_to_end(uri)
        while len(self._resolved) > RESOLVED_CACHE_SIZE:
            self._resolved.popitem(last=False)
        return resolved

    async def article(self, event: NostrEvent) -> ReferencedArticle | None:
        """The article an ``a`` tag ``30023:<pubkey>:<d>`` of ``event`` names, when it is found."""
        for value in event.tag_values(TAG_ADDRESS):
            kind, _, rest = value.partition(":")
            author, _, identifier = rest.partition(":")
            if kind != str(KIND_ARTICLE) or not identifier:
                continue
            entity = nip19.Entity("naddr", identifier, (), author, KIND_ARTICLE)
            article = await self._event(entity)
            if article is None:
                log.info("article_unresolved", identifier=identifier)
                return None
            return ReferencedArticle(
                title=article.tag_value(TAG_TITLE) or f"Context: {identifier}",
                content=article.content,
                identifier=identifier,
                author=author,
            )
        return None

    async def _content(self, uri: str) -> str | None:
        event = await self._event(nip19.decode(uri))
        return None if event is None else event.content

    async def _event(self, entity: nip19.Entity) -> NostrEvent | None:
        if self._resolver is None:
            return None
        try:
            async with asyncio.timeout(self._timeout):
                event = await self._resolver.resolve(entity)
        except TimeoutError:
            log.warning("reference_unresolved", entity=entity.kind_name, reason="timeout")
            return None
        except Exception:
            log.exception("reference_unresolved", entity=entity.kind_name, reason="resolver_error")
            return None
        if event is not None and not event.has_valid_id():
            log.warning("reference_unresolved", entity=entity.kind_name, reason="bad_id")
            return None
        return event
