"""Errors that are the user's to fix: the CLI prints them as one line and exits 2, no traceback."""


class UserError(Exception):
    """A mistake in the user's input (config, flags, environment) with a message that says how to fix it."""

    exit_code = 2


class ToldInterrupt(KeyboardInterrupt):
    """A Ctrl-C whose line (what stopped, and the command that goes on) the command has printed:
    the CLI adds nothing to it but the exit status, 130."""


class ConfigError(UserError):
    """A config value is wrong; the message starts with its key path (``search_space.lr: ...``)."""
