"""Conversation stores: memory, filesystem, PostgreSQL."""
