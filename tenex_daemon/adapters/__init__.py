"""Adapters: concrete Nostr, storage and LLM implementations of the core ports."""
