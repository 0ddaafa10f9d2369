"""Communication kernels (NCCL / RCCL collectives) and the part of their time left exposed.

A communication kernel is a device event whose name contains "nccl" (``ncclKernel_*``,
``ncclDevKernel_*``; RCCL keeps NCCL's names). The host ops that issue a collective
(``c10d::allreduce_``, ``record_param_comms``, the ``nccl:all_reduce`` annotation, ...) are
ordinary ops inside the module call that made them, never module calls of their own
(identity.py leaves them out of the ``record_function`` ranges), so a collective's kernels
belong to the module whose call launched them, as every other kernel does.

Exposed time: the part of a communication kernel's interval that no non-communication kernel
on another stream of the same device overlaps, i.e. the time the device spent on nothing but
communication (memcpy / memset do not count as covering). Intervals are merged and measured
with sorted arrays (``intervals.union``, ``intervals.covered``): one pass per (device,
communication stream).
"""
from __future__ import annotations

import re

import numpy as np

from cbtrace.attribution.intervals import covered, union

_KERNEL = re.compile("nccl", re.IGNORECASE)
_OP = re.compile(r"^(nccl:|gloo:|c10d::|_?c10d_functional::|record_param_comms$)")
COMPUTE_CATS = frozenset({"kernel", "Kernel", "mtia_ccp_events"})


def is_comm_kernel(name: str) -> bool:
    return _KERNEL.search(name) is not None


def is_comm_op(name: str) -> bool:
    """A host op or annotation of a collective (c10d::allreduce_, nccl:all_reduce, ...)."""
    return _OP.match(name) is not None


def exposed(ts, dur, comm, compute, device, stream) -> np.ndarray:
    """Per device event: µs of a communication event (``comm``) that no ``compute`` event of
    the same ``device`` on another ``stream`` overlaps; 0 for the other events."""
    out = np.zeros(len(ts))
    if not comm.any():
        return out
    pairs = np.unique(np.c_[device[comm], stream[comm]], axis=0)
    for dev, st in pairs.tolist():
        c = np.flatnonzero(comm & (device == dev) & (stream == st))
        k = np.flatnonzero(compute & ~comm & (device == dev) & (stream != st))
        lo, hi = union(ts[k], ts[k] + dur[k])
        out[c] = dur[c] - covered(lo, hi, ts[c], ts[c] + dur[c])
    return np.maximum(out, 0.0)
