"""One kind of user-facing error, one exit-code table (:data:`EXIT_CODES`, printed by
``k3rocm --help``) for every command, and one progress log.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

EXIT_OK = 0
EXIT_CHECK_FAILED = 1
EXIT_USAGE = 2
EXIT_SERVER = 3
EXIT_INCOMPLETE = 4
EXIT_INTERRUPTED = 130

EXIT_CODES = {
    EXIT_OK: "ok",
    EXIT_CHECK_FAILED: "a check failed (results kept, marked failed)",
    EXIT_USAGE: "bad input (a setting, flag, file or image; nothing expensive was started)",
    EXIT_SERVER: "server or engine problem (server unreachable/unhealthy, no Docker engine)",
    EXIT_INCOMPLETE: "incomplete evidence (a trace lost events, or cannot judge; nothing judged)",
    EXIT_INTERRUPTED: "interrupted (finished work kept)",
}


class UsageError(Exception):
    """A setting or input is wrong; the message says what and what would be valid. The CLI
    prints it on one line and exits with ``exit_code`` (2 unless said otherwise).
    """

    def __init__(self, message: str, exit_code: int = EXIT_USAGE):
        super().__init__(" ".join(message.split()))
        self.exit_code = exit_code


class ServerError(UsageError):
    """The server or the Docker engine is not there or not well: exit 3."""

    def __init__(self, message: str):
        super().__init__(message, EXIT_SERVER)


def one_line(exc: Any, subject: Callable[[tuple[str, ...], Any], str],
             what: Callable[[str, dict[str, Any]], str | None]) -> str:
    """The first error of pydantic's ValidationError ``exc`` as ``<subject> <what>``, the one
    formatter of every settings, options and profile error. ``subject(loc, input)`` names the
    value (a flag, ``K3_X='v'``, a file's key; ``loc`` without dict keys' ``[key]``); ``what(kind,
    err)`` says what is wrong and what to use for error type ``kind`` (``range`` for any bound;
    ``err["msg"]`` without ``Value error, ``), or None: ``is not valid: <pydantic's message>``."""
    err = exc.errors()[0]
    err["loc"] = tuple(str(p) for p in err["loc"] if p != "[key]")
    err["msg"] = err["msg"].removeprefix("Value error, ")
    kind = "range" if err["type"].startswith(("greater", "less")) else err["type"]
    told = what(kind, err) or f"is not valid: {err['msg']}"
    return f"{subject(err['loc'], err.get('input'))} {told}".strip()


def tagged_log(tag: str) -> Callable[[str], None]:
    """``[tag] message`` progress lines on stderr (stdout carries results), flushed at once."""
    def log(msg: str) -> None:
        print(f"[{tag}] {msg}", file=sys.stderr, flush=True)
    return log
