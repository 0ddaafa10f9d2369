"""``graph`` timer: K calls in one CUDA graph, replayed between events (no host launch latency)."""
from __future__ import annotations

import warnings

import torch

from cbtrace.device import free_memory, hand_back
from cbtrace.errors import one_line
from cbtrace.replay.timer.graph_capture import (ASKS_CAPTURE, capturing, end_pool_routing,
                                                root_cause, side_stream_warmup,
                                                watch_capture_checks)
from cbtrace.replay.timer.contract import (CallRunner, Timing, TimerUnavailable, TimingConfig,
                                           as_runner, join_notes)
from cbtrace.replay.timer.stats import EVENT_JITTER_MS, graph_calls

from .events import CudaTimer, event_pairs
from .l2 import L2Flusher, spin
from .sampling import collect, timing_from_samples, warm_until_settled


def capture(call, n_copies: int, k: int, touch=None, stream=None,
            slots: bool = False) -> torch.cuda.CUDAGraph:
    """Capture k calls (cycling input copies; each after ``touch(j)`` when given) into one
    graph on ``stream`` (a fresh one by default); TimerUnavailable if capture fails or the
    call looks at whether it is being captured. ``slots``: the call was staged (see
    ``staged``) and is called with its slot j, which it maps to a copy itself."""
    g = torch.cuda.CUDAGraph()
    asked: list = []
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*empty.*")  # a call that launches nothing
            # a side stream (capture refuses the default one): the caller's, shared by all of a
            # call's captures, else a fresh one
            with capturing(g, stream or torch.cuda.Stream()), watch_capture_checks(asked):
                for j in range(k):
                    if touch is not None:
                        touch(j % n_copies)
                    call(j if slots else j % n_copies)
    except Exception as e:  # capture errors come as RuntimeError, AcceleratorError, OOM, ...
        end_pool_routing(g)
        del g
        cause = one_line(root_cause(e))
        try:
            torch.cuda.synchronize()
        except Exception as e2:
            raise TimerUnavailable(f"graph capture failed ({cause}) and left CUDA "
                                   f"unusable ({one_line(e2)})") from e
        raise TimerUnavailable(f"graph capture failed: {cause}") from e
    if asked:
        g.reset()
        raise TimerUnavailable(f"{ASKS_CAPTURE}; timed without a graph")
    return g


def staged(call: CallRunner, n_copies: int, k: int, touch=None,
           stream=None) -> torch.cuda.CUDAGraph:
    """``capture`` of k calls; a call with ``stage(j)`` (untimed work its slot j needs first,
    such as the forward whose backward the call is) has it run eagerly for every slot on the
    capture stream, so that only the call itself is in the graph: work an op does on its
    forward's stream (autograd's backward) then lands in the capture. Slots staged before are
    released first (their memory); all k slots are alive at once, so running out of memory
    while staging them asks for another timer, as a failed capture does, after one more try
    with torch's cached blocks handed back to the driver: a capture may not free them itself
    (no cudaFree while capturing), and earlier calls' graph pools leave many cached."""
    stream = stream or torch.cuda.Stream()
    try:
        return _staged(call, n_copies, k, touch, stream)
    except TimerUnavailable as e:
        if "out of memory" not in str(e).lower():
            raise
    if call.unstage is not None:
        call.unstage()
    hand_back(stream.device)  # graphs in reference cycles hold their pools until collected
    return _staged(call, n_copies, k, touch, stream)


def _staged(call: CallRunner, n_copies: int, k: int, touch, stream) -> torch.cuda.CUDAGraph:
    stage = call.stage
    if stage is not None:
        call.unstage()
        stream.wait_stream(torch.cuda.current_stream())
        try:
            with torch.cuda.stream(stream):
                for j in range(k):
                    stage(j)
        except torch.OutOfMemoryError as e:
            call.unstage()
            raise TimerUnavailable(f"staging {k} forwards ran out of memory "
                                   f"({one_line(e)})") from e
    return capture(call.run, n_copies, k, touch, stream, slots=stage is not None)


def slots_that_fit(device, per_slot_bytes: int, share: float = 0.5) -> int:
    """How many staged slots of ``per_slot_bytes`` fit in ``share`` of free device memory."""
    free = free_memory(device)
    return max(1, int(share * free) // max(per_slot_bytes, 1))


# Whether a spin kernel is queued after the L2 flush too: the flush already keeps the GPU busy
# while the host records the start event and launches the graph (as in triton.testing.do_bench),
# so a spin on top is dead time (benchmarks/RESULTS.md). With no flush (``flush_l2`` off or its
# buffer did not fit) the spin covers the launch. profile_models.py's +spin variant sets this.
SPIN_UNDER_FLUSH = False


def gap_ms(cfg: TimingConfig, flushing: bool) -> float:
    """The spin queued before each timed replay (ms): ``cfg.gap_s``, and ``cfg.spin_min_ms``
    when no flush precedes it (or ``SPIN_UNDER_FLUSH``)."""
    spin_ms = cfg.spin_min_ms if SPIN_UNDER_FLUSH or not flushing else 0.0
    return cfg.gap_s * 1e3 + spin_ms


def replay_ms(g: torch.cuda.CUDAGraph) -> float:
    """One replay timed with events (after the caller's warm replay)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    g.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


class GraphTimer(CudaTimer):
    name = "graph"
    fallback_rank = 30  # cbtrace.replay.timer.choice: auto order and fallbacks

    def measure(self, call: CallRunner, n_copies: int, device, cfg: TimingConfig) -> Timing:
        device = self._device(device)
        call = as_runner(call, n_copies)
        n_copies = call.n_copies
        if not call.graph_ok:
            raise TimerUnavailable("the call may not be captured into a CUDA graph")
        # untimed work in each slot, timed alone and subtracted: the call's context
        # (measure.context), or its inputs' rewrite; a staged call's runs outside the graph
        touch = call.before if call.stage is None else None
        graphs = []
        with torch.cuda.device(device):
            stream = torch.cuda.Stream()  # every capture of this call: staged nodes keep it
            side_stream_warmup(call.run, n_copies, cfg.warmup_runs, stream)
            try:
                # K from the call's device time where the plan measured it, else from one call
                # captured first: K = 20 straight away runs long GEMMs back to back before
                # sampling, and the SM clock drops.
                expected, k_max = call.expected_ms, cfg.graph_k
                if not expected:
                    before = torch.cuda.memory_allocated(device)
                    graphs.append(staged(call, n_copies, 1, touch, stream))
                    if call.stage is not None:  # K slots live at once: K of these must fit
                        per_slot = torch.cuda.memory_allocated(device) - before
                        k_max = min(k_max, slots_that_fit(device, per_slot))
                    graphs[0].replay()  # warm replay: first launch uploads the graph
                    expected = replay_ms(graphs[0])
                k = graph_calls(per_call_ms=expected, k_max=k_max,
                                max_replay_ms=cfg.graph_max_ms)
                if not graphs or k > 1:
                    graphs.append(staged(call, n_copies, k, touch, stream))
                g = graphs[-1]
                # warm inputs: the same touches alone, timed beside the calls and subtracted
                t = capture(lambda i: None, n_copies, k, touch) if touch else None
                graphs.append(t)
                for x in (g, t):
                    if x is not None:
                        x.replay()
                torch.cuda.synchronize()
                flusher = L2Flusher(device, cfg.flush_bytes, cfg.flush_l2)
                sampler = self._sampler(g, t, k, device, cfg, flusher)
                settle = warm_until_settled(sampler, cfg)
                samples = collect(sampler, cfg, floor_ms=EVENT_JITTER_MS / k)
            finally:
                for x in graphs:
                    if x is not None:
                        x.reset()
                if call.unstage is not None:
                    call.unstage()
        notes = join_notes(f"K={k}", flusher.note, settle,
                           "warm inputs" if touch is not None and call.warms_inputs else None)
        return timing_from_samples(samples, self.name, notes, calls_per_run=k)

    @staticmethod
    def _sampler(g, touches, k: int, device, cfg: TimingConfig, flusher: L2Flusher):
        """Per-call times of replays of ``g`` (K calls), less the replay of ``touches`` (the
        same K input touches alone) taken just before each, when there is one."""
        stream = torch.cuda.current_stream(device)  # looked up once: Python time per call
        spin_ms = gap_ms(cfg, flusher.buf is not None)

        def replay(graph, start, end):
            flusher.flush()
            spin(device, spin_ms)  # with no flush before it: covers the host's graph launch
            start.record(stream)
            graph.replay()
            end.record(stream)

        def sample(first: int, n: int) -> list[float]:
            calls = event_pairs(n)
            alone = event_pairs(n) if touches is not None else None
            for i, (start, end) in enumerate(calls):
                if alone is not None:
                    replay(touches, *alone[i])
                replay(g, start, end)
            torch.cuda.synchronize()
            ms = [start.elapsed_time(end) for start, end in calls]
            if alone is not None:
                ms = [m - s.elapsed_time(e) for m, (s, e) in zip(ms, alone)]
            return [m / k for m in ms]

        return sample
