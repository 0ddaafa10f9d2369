"""Registers the built-in timers through the same hook third-party backends use."""
from cbtrace.hookspecs import hookimpl


@hookimpl
def register_backends(register):
    from .cpu import CpuTimer  # torch is imported only when backends are asked for
    from .events import EventsTimer
    from .graph import GraphTimer
    from .stream import StreamTimer

    register("graph", GraphTimer())
    register("stream", StreamTimer())
    register("events", EventsTimer())
    register("cpu", CpuTimer())
