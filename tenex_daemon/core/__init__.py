"""Pure domain: events, conversations, phases, turns, execution time and context building.

Nothing in this package performs I/O, imports a Nostr library or uses asyncio.
"""
