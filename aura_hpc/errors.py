"""User-facing errors: each carries one line that names the problem and the fix."""

from __future__ import annotations


class AuraError(Exception):
    """An error whose message is meant for the user as-is (no traceback)."""

    exit_code = 2


class ConfigError(AuraError):
    pass


class DataError(AuraError):
    pass


class LaunchError(AuraError):
    pass


class CheckpointError(AuraError):
    pass


# Exit statuses a launcher can read.
EXIT_OK = 0
EXIT_USER_ERROR = 2
EXIT_TRAIN_FAILED = 1
