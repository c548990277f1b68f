"""The one root of every error a user can cause: `DresdError`.

The `dresd` command turns a `DresdError` into one line, `dresd: error: ...`, and exit status 2:
its message says what was wrong and what to do. Any other exception is a bug in dresd and is
reported as one (`dresd: internal error: ...`, exit status 1, the traceback with `--debug`).
So code that finds a bad input raises a `DresdError` where it checks it, with a message written
for the user; a plain `ValueError` escaping from deep inside means a check is missing.

    DresdError
      UserError            a bad value, prompt or combination of options (also a ValueError)
      MissingPackageError  an optional package is not installed (also an ImportError)
      ModelError           models.py: a model that cannot be loaded
      DeviceError          device.py: a device that is not there
      CorpusError          corpus.py: a corpus that cannot be read
      DatastoreError       datastore/format.py: a store missing, damaged or for another model

A class that callers also catch as `ValueError` keeps that base too: the server turns a
`ValueError` from a request's options into a 400 reply.
"""

from __future__ import annotations


class DresdError(Exception):
    """A failure the user caused or can fix; the message says what to do."""


class UserError(DresdError, ValueError):
    """A bad value (an option out of range, an empty prompt) or options that do not go
    together."""


class MissingPackageError(DresdError, ImportError):
    """An optional package is not installed; the message names what to `pip install`."""
