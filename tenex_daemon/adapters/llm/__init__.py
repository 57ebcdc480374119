"""LLM backends."""
