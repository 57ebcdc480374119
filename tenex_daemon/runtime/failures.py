"""How a failure is logged: with its traceback when it is a defect or an unexpected fault, as one line
when the error says it is ``logged_briefly`` (the store does not answer, its database down: the traceback
says nothing an operator can use, and an outage would repeat it every few seconds; ``tenexd status`` says
``degraded`` meanwhile)."""

from __future__ import annotations

from typing import Any


def log_failure(
    log: Any, event: str, error: BaseException, *, brief: tuple[type[BaseException], ...] = (), **fields: Any
) -> None:
    """Log ``event`` for ``error``: a warning of one line for an error ``logged_briefly`` (the core's
    ``StoreUnavailableError``) or of a ``brief`` type (a full disk's ``OSError`` where the caller knows
    what failed), else an error with the traceback."""
    if getattr(error, "logged_briefly", False) or isinstance(error, brief):
        log.warning(event, error=str(error), **fields)
    else:
        log.error(event, error=repr(error), exc_info=(type(error), error, error.__traceback__), **fields)
