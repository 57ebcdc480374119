"""The local HTTP control API, one module per job.

``paths`` (where each endpoint lives), ``errors``, ``parsing`` (query parameters and bodies
checked), ``views`` (conversations and contexts as JSON, shared with the CLI), ``routes`` (the
aiohttp application: handlers and the error middleware), ``openapi`` (the OpenAPI 3 document)
and ``server`` (the Unix socket and loopback TCP listeners). Callers import these names from
:mod:`tenex_daemon.app.control_api`.
"""
