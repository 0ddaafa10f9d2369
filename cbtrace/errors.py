"""User-facing errors. The CLI turns each into a one-line message."""


class CbtraceError(Exception):
    """Base class: its message is meant for users and names the file or module at fault."""


class RunDirError(CbtraceError):
    """A run directory is missing, incomplete, corrupt or would be overwritten."""


class CaptureError(CbtraceError):
    """Capturing a model step failed."""


class SerializationError(CbtraceError):
    """An input could not be stored, or stored data could not be read back."""


class TraceError(CbtraceError):
    """A Kineto trace could not be read or makes no sense."""


class ProviderError(CbtraceError):
    """A model spec could not be resolved to a model and a batch."""


class ReplayError(CbtraceError):
    """Replay of a run could not start or continue."""


class PluginError(CbtraceError):
    """A plugin registered something invalid (e.g. the same name twice)."""


class SchemaError(CbtraceError):
    """A stage or plugin wrote a column the run-directory schema does not declare for it."""
