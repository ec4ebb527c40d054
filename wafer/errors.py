"""Errors that users see: each names what is wrong and where."""


class WaferError(Exception):
    """Base for errors whose message is meant for the user as it is."""


class ModelLoadError(WaferError):
    """A model file or directory is missing, corrupt or of an unsupported kind."""
