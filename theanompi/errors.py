"""Errors meant for the user: the CLI prints them as one line and exits non-zero."""

__all__ = ["UserError", "ConfigError", "DataError", "EXIT_USAGE", "EXIT_DATA", "EXIT_FAILURE"]

EXIT_FAILURE = 1  # an unexpected failure (a bug, a crashed rank)
EXIT_USAGE = 2  # bad config, flag or argument: fix the command line or the YAML
EXIT_DATA = 3  # bad or missing input data: fix the files


class UserError(Exception):
    """A problem the user can fix; ``str(err)`` says what and how, in one line."""

    exit_code = EXIT_USAGE


class ConfigError(UserError):
    """A YAML key, value or flag is wrong."""

    exit_code = EXIT_USAGE


class DataError(UserError):
    """Input data is missing, corrupt or inconsistent."""

    exit_code = EXIT_DATA
