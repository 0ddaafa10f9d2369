"""What every CUDA graph capture of a module call needs, for the graph timer and the
cudagraph mode alike: a warm-up on a side stream, a watch on code that asks whether it is
being captured, the op that really broke a failed capture, and the allocator's routing undone.
"""
from __future__ import annotations

import contextlib
import gc
import weakref

import torch

ASKS_CAPTURE = ("the call asks torch.cuda.is_current_stream_capturing() and may run other code "
                "under graph capture than in its step (transformers then keeps an all-ones "
                "attention mask its eager step drops)")

_DEVICE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # graph -> device it captured on

# A capture may not hand torch's cached blocks back to the driver (no cudaFree while capturing):
# an allocation the driver cannot serve then fails the capture. A reset graph's private pool
# stays cached until empty_cache, so a replay of many captured calls fills the device with idle
# cache (benchmarks/RESULTS.md, session 23). Before a capture the cache goes back to the driver
# when the driver's free memory is below this share of the device's.
ROOM_SHARE = 0.25
ROOM_MIN_BYTES = 1 << 30  # and only when at least this much of the cache is idle: less is not
# worth the synchronisation and the fresh allocations after it, capture after capture


def needs_room(free: int, total: int, idle: int, share: float = ROOM_SHARE) -> bool:
    """Whether to hand the cache back before a capture: the driver has less than ``share`` of
    the device free, and torch caches at least ``ROOM_MIN_BYTES`` it does not use (``idle``:
    reserved less allocated, less the free parts of split blocks, which it cannot return)."""
    return free < share * total and idle >= ROOM_MIN_BYTES


def make_room(device=None) -> bool:
    """``empty_cache`` when ``needs_room`` says so (a cudaMemGetInfo and the allocator's stats
    otherwise: microseconds); whether it did."""
    free, total = torch.cuda.mem_get_info(device)
    if free >= ROOM_SHARE * total:
        return False
    stats = torch.cuda.memory_stats(device)
    idle = (stats.get("reserved_bytes.all.current", 0) - stats.get("allocated_bytes.all.current", 0)
            - stats.get("inactive_split_bytes.all.current", 0))
    if not needs_room(free, total, idle):
        return False
    torch.cuda.empty_cache()
    return True


@contextlib.contextmanager
def capturing(g: torch.cuda.CUDAGraph, stream: torch.cuda.Stream, pool=None):
    """``torch.cuda.graph(g, pool, stream)`` without its ``empty_cache()``: that hands every
    cached block back to the driver before each capture, so the next call's input copies, the
    L2-flush buffer and the graph's own pool are allocated afresh (cudaMalloc) for each of the
    two or three captures a timed call makes. As in torch, capture_end runs even when the body
    raises, and its 'invalidated' error then names the body's error as its context.

    The capture forbids unsafe CUDA calls on this thread only ("thread_local"): under torch's
    default ("global"), calls from any other thread of the process invalidate it (the
    read-ahead thread's allocations would). The cache is handed back first where the driver
    is short of memory (``make_room``)."""
    torch.cuda.synchronize()
    make_room(stream.device)
    _DEVICE[g] = stream.device.index  # end_pool_routing's device after a failed capture
    with torch.cuda.stream(stream):
        pooled = {} if pool is None else {"pool": pool}  # as torch.cuda.graph passes it
        g.capture_begin(**pooled, capture_error_mode="thread_local")
        try:
            yield g
        finally:
            g.capture_end()


def side_stream_warmup(call, n_copies: int, runs: int, stream=None) -> None:
    """Warm up on a side stream before capture, as the torch.cuda.graphs docs require: on the
    stream that will capture when given (what torch keeps per stream, such as cuBLAS's
    workspace, is then made outside the capture), else on a fresh one."""
    side = stream or torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(max(runs, 1)):
            call(i % n_copies)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()


@contextlib.contextmanager
def watch_capture_checks(asked: list):
    """Note every call of ``torch.cuda.is_current_stream_capturing`` that answers yes: code
    that branches on it (transformers' mask creation) would be timed on a path its real step
    does not take (transformers then keeps an all-ones attention mask). cbtrace's
    own checks call ``torch._C._cuda_isCurrentStreamCapturing`` and are not noted."""
    original = torch.cuda.is_current_stream_capturing

    def watched():
        capturing = original()
        if capturing:
            asked.append(True)
        return capturing

    torch.cuda.is_current_stream_capturing = watched
    try:
        yield
    finally:
        torch.cuda.is_current_stream_capturing = original


def root_cause(e: BaseException) -> BaseException:
    """The op that broke the capture, not capture_end's 'invalidated' error raised after it."""
    for _ in range(5):
        if e.__context__ is None or "captur" not in str(e):
            break
        e = e.__context__
    return e


def end_pool_routing(g: torch.cuda.CUDAGraph) -> None:
    """Undo what a failed capture leaves behind: allocations routed to its pool, and the CUDA
    generator left in capture mode (capture_end raised before giving it back, and every later
    random op outside a capture fails: "Offset increment outside graph capture encountered
    unexpectedly"). Only the capturing device's default generator was registered with the
    graph: it gets a fresh state object with the same seed and offset, which is not capturing;
    the other devices' generators keep theirs (graphs elsewhere may hold them).

    The capturing device is the stream's that ``capturing`` was given, else the current one.
    Before pytorch#180395 (torch < 2.12), capture_end skipped this when cudaStreamEndCapture
    failed, and a later empty_cache died on 'captures_underway.empty() INTERNAL ASSERT'.
    Where torch already did it, the call raises 'not currently recording'; that is ignored.
    """
    device = _DEVICE.get(g)
    if device is None:
        device = torch.cuda.current_device()
    with contextlib.suppress(Exception):
        torch._C._cuda_endAllocateToPool(device, g.pool())
    gen = torch.cuda.default_generators[device]
    # capture_begin names the generator's state in the graph before it names the graph in the
    # state; where the second step raised (it refuses while the stream is capturing, and
    # allocates on the device), the graph's destructor raises from a destructor and the
    # process aborts ("The graph should be registered to the state"). Registering the same
    # state again (not capturing now) completes both sides; it is a no-op where they agree.
    with contextlib.suppress(Exception):  # torch without graph-safe generator states
        g.register_generator_state(gen)
    with contextlib.suppress(Exception):
        gen.graphsafe_set_state(gen.clone_state())


class MainThreadCollection:
    """Cyclic garbage collected on this thread only, between calls: automatic collection off
    inside the block, ``between()`` collecting what is due as the interpreter would have.

    A graph in a reference cycle (a failed capture's frames hold it) is destroyed by the
    collection that finds it, run by whichever thread's allocation triggered it: the
    read-ahead thread's, while this thread is inside capture_begin or replay, which torch
    runs without the GIL. The destructor and capture_begin both edit the generator state's
    set of registered graphs, and a graph that set has lost aborts the process when it is
    destroyed. Timing gains too: no collection pauses inside a call's timed runs (as timeit
    turns collection off). Collection is put back as it was found. Cycles made inside one call
    wait for the end of the call."""

    def __enter__(self):
        self.was_enabled = gc.isenabled()
        gc.disable()
        return self

    def between(self) -> None:
        """The young collections the interpreter would have run by now, if any: generation 0
        once its count passes its threshold, generation 1 as its own count does. Never a full
        one (the interpreter holds those back while the long-lived heap, here torch and the
        model, is large); nothing where collection was off already."""
        if not self.was_enabled:
            return
        counts, thresholds = gc.get_count(), gc.get_threshold()
        if not thresholds[0] or counts[0] <= thresholds[0]:
            return
        gc.collect(1 if len(counts) > 1 and thresholds[1] and counts[1] > thresholds[1] else 0)

    def __exit__(self, *exc):
        if self.was_enabled:
            try:
                gc.collect(1)  # the last calls' cycles, here rather than on another thread
            finally:
                gc.enable()
        return False
