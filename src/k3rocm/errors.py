"""One kind of user-facing error: a one-line message, exit code 2, no traceback."""

from __future__ import annotations


class UsageError(Exception):
    """A setting or input is wrong. The message says what is wrong and what would be valid.

    The CLI prints ``k3rocm: error: <message>`` on one line and exits with ``exit_code``.
    """

    def __init__(self, message: str, exit_code: int = 2):
        super().__init__(" ".join(message.split()))
        self.exit_code = exit_code
