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


class TrainingError(AuraError):
    """Training cannot go on (e.g. the loss stays non-finite after every rollback)."""

    exit_code = 3


# Exit statuses a launcher can read.
EXIT_OK = 0
EXIT_TRAIN_FAILED = 1
EXIT_USER_ERROR = 2
EXIT_DIVERGED = 3
# Stopped on a signal (SIGTERM, SIGINT, SIGUSR2) after writing a checkpoint: re-run to resume.
# 75 is EX_TEMPFAIL in sysexits.h: "temporary failure, try again".
EXIT_RESUMABLE = 75
# The GPU circuit breaker opened: a hardware fault; orchestrators should drain the node, not retry on it.
EXIT_GPU_FAULT = 76
