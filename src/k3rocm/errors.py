"""One kind of user-facing error, one exit-code table for every command, and one progress log.

Every ``k3rocm`` command (and the make targets that run them) exits with one of these codes:

====  ==========================================================================================
0     ok: every check passed / the work is done
1     a check failed (a gate, a census check, a bench point): results are kept, marked failed
2     bad input: a setting, a flag, a missing file or image; nothing expensive was started
3     server or engine problem: the server is unreachable/unhealthy/serves another model, or
      there is no Docker engine
4     incomplete evidence: the input is well formed but cannot be judged: it lost data (a
      profiler trace that lost kernel events or ranks: re-collect it) or cannot prove or refute
      the claim (census CANNOT JUDGE, with the reason)
130   interrupted (Ctrl-C): finished work is kept in the run directory
====  ==========================================================================================
"""

from __future__ import annotations

import sys
from collections.abc import Callable

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
    """A setting or input is wrong. The message says what is wrong and what would be valid.

    The CLI prints ``k3rocm: error: <message>`` on one line and exits with ``exit_code``
    (one of :data:`EXIT_CODES`; 2 unless said otherwise).
    """

    def __init__(self, message: str, exit_code: int = EXIT_USAGE):
        super().__init__(" ".join(message.split()))
        self.exit_code = exit_code


class ServerError(UsageError):
    """The server or the Docker engine is not there or not well: exit 3."""

    def __init__(self, message: str):
        super().__init__(message, EXIT_SERVER)


def tagged_log(tag: str) -> Callable[[str], None]:
    """The progress log of one part: ``[tag] message`` lines on stderr (stdout carries results),
    flushed at once so they interleave in order with the subprocesses' own output."""
    def log(msg: str) -> None:
        print(f"[{tag}] {msg}", file=sys.stderr, flush=True)
    return log
