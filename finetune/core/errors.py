"""The one exception type the application turns into a one-line message and exit code 2."""

from __future__ import annotations


class UserError(Exception):
    """A problem with the user's config, data, model path or output directory.

    Entry points print `error: <message>` on stderr and exit with code 2, no traceback.
    """
