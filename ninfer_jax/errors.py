"""Typed errors for bad input to the model layer: each message names the thing that is wrong."""


class NinferError(Exception):
    """Base of the project's user-facing errors."""


class ConfigError(NinferError, ValueError):
    """A config value is missing, unknown or unsupported."""


class CheckpointError(NinferError, ValueError):
    """A checkpoint or artifact is absent, unreadable, or does not match its config."""
