"""asyncio runtime helpers shared by services, adapters and the app (imports nothing of tenexd)."""
