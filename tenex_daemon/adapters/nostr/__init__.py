"""Nostr adapters: codec, relay pool, publisher, signers."""
