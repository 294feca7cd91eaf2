"""The one base of selfdraft's user-facing errors and its exit code at the command line.

Every error whose message tells the user what to fix derives from `SelfdraftError`: bad
configuration (config.ConfigError, and checkpoint.CheckpointError / bench DatasetError under it),
a target that cannot be loaded or used (target_loading.TargetError), unusable training data
(training.records.DataError). The CLI maps them to exit codes in one place (cli/common.py); the HTTP
server maps request errors to status codes separately (serve/protocol.py).
"""

from __future__ import annotations


class SelfdraftError(ValueError):
    """A problem with the user's input; the message says what to fix. `exit_code` is the CLI's."""

    exit_code: int = 2  # command-line usage error, like a bad option
