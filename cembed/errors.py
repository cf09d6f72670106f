"""The one exception type for user mistakes.

Anything the user can fix (a config value, a data file, a CLI argument) raises :class:`UserError`
with a one- or two-line message that names the file, line or field and says how to fix it. The CLI
prints the message and exits with code 2; it never shows a traceback for these.
"""

from __future__ import annotations


class UserError(Exception):
    """A mistake in user input. ``str(err)`` is the full message shown to the user."""

    exit_code = 2
