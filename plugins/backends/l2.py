"""Flush and spacing between timed GPU runs: an L2-flushing memset and a queued spin kernel.

Heavy GEMMs run back to back pull the SM clock down within a fraction of a second; a 256 MB
memset between timed calls, as in ``triton.testing.do_bench``, keeps it up and also stops
repeated identical inputs (EmbeddingBag lookups) from being served out of a warm L2
(benchmarks/RESULTS.md).
"""
from __future__ import annotations

import torch

from cbtrace.device import sm_clock_mhz

_cycles_per_ms: dict[int, float] = {}  # device index -> spin-kernel clock cycles per ms (measured)
NOMINAL_MHZ = 1500.0  # where no clock reading holds together: a spin only spaces runs


class L2Flusher:
    """Owns a GPU buffer; ``flush()`` queues a memset over it. No-op when disabled or not CUDA."""

    def __init__(self, device: torch.device, nbytes: int, enabled: bool = True):
        self.buf, self.note = None, None
        if enabled and device.type == "cuda" and nbytes > 0:
            try:
                self.buf = torch.empty(nbytes, dtype=torch.int8, device=device)
            except torch.OutOfMemoryError:  # the module needs the memory more than we do
                self.note = f"no L2 flush: {nbytes >> 20} MiB buffer did not fit"

    def flush(self) -> None:
        if self.buf is not None:
            self.buf.zero_()


def cycles_per_ms(device: torch.device) -> float:
    """Clock cycles of ``torch.cuda._sleep`` per millisecond on this device, read once
    (``cbtrace.device.sm_clock_mhz``; a spin only spaces runs, so a nominal clock stands in
    where no reading holds together)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _cycles_per_ms:
        mhz = sm_clock_mhz(torch.device("cuda", index))
        _cycles_per_ms[index] = (mhz or NOMINAL_MHZ) * 1e3
    return _cycles_per_ms[index]


def spin(device: torch.device, ms: float) -> None:
    """Queue a kernel that keeps one SM busy for about ``ms`` (the host returns at once)."""
    if ms > 0:
        torch.cuda._sleep(max(int(ms * cycles_per_ms(device)), 1))
