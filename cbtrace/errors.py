"""User-facing errors. The CLI turns each into a one-line message."""


class CbtraceError(Exception):
    """Base class: its message is meant for users and names the file or module at fault.

    An error about one argument's value passes ``param`` (the library's argument name, e.g.
    ``"max_depth"``) and ``value``: the message reads ``max_depth -1: <reason>``, and the CLI
    names its flag instead (``--max-depth -1: <reason>``, ``for_flag``).

    An error that an argument of the call would let go on passes ``retry`` (e.g. ``"force"``,
    or several names) and says so as ``force=True`` or ``model_spec=SPEC`` in its message
    ("pass force=True to overwrite it"); the CLI puts its flag there instead ("pass --force to
    overwrite it", ``for_cli``).
    """

    param = value = retry = None  # for a subclass whose __init__ does not pass them on
    reason = ""

    def __init__(self, message: str = "", *, param: str | None = None, value=None,
                 retry: str | tuple[str, ...] | None = None):
        self.param, self.value, self.reason, self.retry = param, value, message, retry
        super().__init__(f"{param} {value}: {message}" if param else message)

    def for_flag(self, flag: str) -> str:
        """The message with the CLI's flag in place of the library argument's name."""
        return f"{flag} {self.value}: {self.reason}" if self.param else str(self)

    @property
    def retries(self) -> tuple[str, ...]:
        """The argument names ``retry`` gives, as a tuple."""
        return () if self.retry is None else (
            (self.retry,) if isinstance(self.retry, str) else tuple(self.retry))

    def for_cli(self, flags: dict[str, str]) -> str:
        """The message with CLI flags (``flags``: library argument -> flag) in place of the
        library arguments it names (``param``, ``retry``); one without a flag keeps its name."""
        text = self.for_flag(flags[self.param]) if self.param in flags else str(self)
        for name in self.retries:
            if name in flags:
                text = text.replace(f"{name}=True", flags[name]).replace(f"{name}=",
                                                                         f"{flags[name]} ")
        return text


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


def one_line(e: BaseException | str, limit: int = 300, *, with_type: bool = True) -> str:
    """The first non-blank line of an exception's message (or of a text), cut to ``limit``.

    With ``with_type`` an exception reads ``"TypeName: first line"``, or ``"TypeName"`` when its
    message is empty; a text is returned as its own first line ("" when blank).
    """
    text = e if isinstance(e, str) else str(e)
    line = next((s.strip() for s in text.splitlines() if s.strip()), "")
    if not isinstance(e, str) and with_type:
        line = f"{type(e).__name__}: {line}" if line else type(e).__name__
    elif not isinstance(e, str) and not line:
        line = type(e).__name__
    return line[:limit]
