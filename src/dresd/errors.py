"""The one root of every error a user can cause: `DresdError`.

The `dresd` command turns a `DresdError` into one line, `dresd: error: ...`, and exit status 2:
its message says what was wrong and what to do. Any other exception is a bug in dresd and is
reported as one (`dresd: internal error: ...`, exit status 1, the traceback with `--debug`).
So code that finds a bad input raises a `DresdError` subclass where it checks it, with a message
written for the user; a plain `ValueError` from deep inside means the check is missing.

Subclasses live beside the code that raises them (`ModelError` in models.py, `DatastoreError` in
datastore/format.py, ...); a class that callers also catch as `ValueError` keeps that base too.
"""

from __future__ import annotations


class DresdError(Exception):
    """A failure the user caused or can fix; the message says what to do."""


class UserError(DresdError):
    """A bad command-line value, file or combination of options."""
