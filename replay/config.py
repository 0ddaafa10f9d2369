"""Replay settings: one keyword-only dataclass; each CLI flag maps to one field. The settings it
shares with the timers take their defaults from ``TimingConfig``, and ``ReplayConfig.timing``
is the one place the timers' settings are derived."""
from __future__ import annotations

from dataclasses import dataclass

from cbtrace.replay.timer.contract import TimingConfig


MODES = ("compile", "cudagraph")  # besides eager, which every replay times
CONTEXT_REWRITES = ("off", "self", "sum")  # ReplayConfig.context_rewrite


@dataclass(kw_only=True)
class ReplayConfig:
    timer: str = "auto"
    """graph | events | cpu | auto (graph on CUDA where capture works, else events; cpu on CPU)."""
    budget_s: float = TimingConfig.budget_s
    """Time budget for the timed runs of one call (adaptive count within it, >= min_runs)."""
    min_runs: int = TimingConfig.min_runs
    """At least this many timed calls, whatever the budget."""
    converge_spread: float = TimingConfig.converge_spread
    """Stop timing a call early once p10..p90 of its samples is within this share of their
    median (its median would not move); 0: not on this ground (``converge_ci`` too off: always
    spend the budget). Not in cold mode."""
    converge_ci: float = TimingConfig.converge_ci
    """Also stop timing a call once its median's 95 % confidence interval is within +- this
    share of the median (0: off): a call whose runs never agree to ``converge_spread`` then
    stops when more runs would not move its median, not at the end of its budget. Not in cold
    mode."""
    converge_ci_floor: bool = TimingConfig.converge_ci_floor
    """The median's interval also counts as converged within +- the timer's own jitter per
    sample (graph timer: 2 us over K calls), for calls of a few microseconds whose 1 % is finer
    than that; off until an A/B on a GPU says what it does (dlrm:large's context-timed ReLUs
    took 21 runs each)."""
    warmup_runs: int = TimingConfig.warmup_runs
    """Untimed calls before timing (graph timer: on its capture stream, what capture needs made
    outside it: lazy init, per-stream workspaces; a warm replay of the graph follows before any
    timed one; more cost wall time without moving the figures: benchmarks/RESULTS.md)."""
    graph_k: int = TimingConfig.graph_k
    """Calls captured in one CUDA graph by the graph timer."""
    cold: bool = False
    """Time each call alone after an L2 flush, as ``triton.testing.do_bench`` does, instead of
    ``graph_k`` calls back to back: the graph timer then captures one call per graph (host
    launch latency still stays out of the events), warms up for at least do_bench's 25 ms and
    until the time stops drifting (``cold_settle_tol``), then samples for do_bench's 100 ms: the
    sustained rate, at the SM clock a long benchmark loop settles at. Default off: K calls back
    to back match the call's in-situ time in a real step; cold matches the kernel-benchmark
    convention."""
    cold_warmup_s: float = 0.025
    """Cold mode: flushed replays run before sampling (do_bench's ``warmup=25`` ms)."""
    cold_settle_tol: float = 0.01
    """Cold mode: also warm up until 25 ms windows agree to this (relative; 0: off; <= 1 s)."""
    cold_budget_s: float = 0.1
    """Cold mode: time budget of the timed runs of one call (do_bench's ``rep=100`` ms)."""
    context: bool | None = None
    """Run, untimed, the calls that ran just before each call in the step before every timed
    run of it (its step-order predecessors, about an L2's worth), an input that equals one of
    their outputs taken from it: the cache then holds what it held in the step
    (``replay.measure.context``). False: each call timed on its own; None: on a GPU only (a CPU
    replay's error is its noise, and context would multiply its time). Never with ``cold``."""
    context_calls: int = 4
    """Most predecessors run before a call in context replay."""
    context_max_ms: float = 0.015
    """Calls timed in their context: those whose device time (the profiled pass) is under this
    (ms). Longer calls set their own cache state, and subtracting a context's graph from a long
    call adds its noise (benchmarks/RESULTS.md, context replay)."""
    context_activation_max_ms: float = 0.1
    """An activation (a leaf without parameters, one tensor in and one of its shape out: ReLU,
    SiLU, GELU; ``context.activation``) is timed in its context up to this device time: in the
    step it reads its producer's output still in L2, alone a cold copy. Other calls keep
    ``context_max_ms``: a longer context spreads the figures of GEMMs and LayerNorms
    (benchmarks/RESULTS.md, session 25)."""
    context_memory_max_ms: float = 0.1
    """A memory-bound call (its FLOPs take less time at the device's peak than its bytes at peak
    bandwidth: a normalisation, an elementwise op; ``context.memory_bound``) is timed in its
    context up to this device time; 0: off. In the step a BatchNorm or an RMSNorm reads the
    output its producer has just written, from L2; over ``context_max_ms`` it was timed without
    that producer, from memory, and read slow. With its kernels' figure
    (``context_kernels_max_ms``) a wider context no longer spreads the LayerNorms' figures
    (benchmarks/RESULTS.md, "The figure of a call in its context")."""
    context_rewrite: str = "sum"
    """A call in context none of whose inputs is a context output (it reads what non-module
    code wrote, such as a residual add): "sum" rewrites its larger floating-point inputs in
    place after the context as an op of two operands of their size would have (x + 0 * y, y
    another copy's: a residual add also read y); "self" as their producer would have left them
    (x * 1); "off": neither (``CONTEXT_REWRITES``). "sum" by default: against "self", every
    call it moved came closer to the step, ResNet-50's post-add ReLUs among them, and none
    went further (benchmarks/RESULTS.md, "The sum rewrite")."""
    context_kernels_max_ms: float = 0.1
    """A call the graph timer ran in its context whose own kernels, profiled in
    ``context_kernel_runs`` runs (at least ``profile_runs``) each after its context
    (``profile_as_timed``; off with it), take less than this (ms) has their
    busy time as its figure (CUPTI's kernel durations, as the step's figure is), their spread
    its p10..p90; longer calls keep the graph difference (K slots of context and call in one
    graph, less a graph of the contexts alone) unless they run ``kernels_figure_min`` kernels
    or more, and the difference stays in ``timer_notes`` either way. The
    difference carries the context's own change between the two graphs, microseconds that
    outweigh a short call; the sparse profiled runs miss the SM clock a step of heavy GEMMs
    runs at, percents on a compute-bound call (NanoGPT's Linears, given a context). At the
    default limits every call in a context is short, memory-bound or an activation
    (benchmarks/RESULTS.md, "The figure of a call in its context"). 0: the graph difference
    but for calls of ``kernels_figure_min`` kernels or more."""
    context_kernel_runs: int = 10
    """Profiled runs of a call in its context that may give its figure
    (``context_kernels_max_ms``): their spread is its p10 and p90."""
    kernels_figure_min: int = 4
    """A call the graph timer ran whose kernels number at least this takes their busy time in
    profiled runs as its figure (``context_kernel_runs`` runs as timed: after its graph, which
    is then a check, on rotating copies, or after its context or on its table copies; a
    backward's its profiled runs), as a short call in its context does; never ``cold``. A
    graph figure holds the device's gap between each two kernels, which the step's busy time
    does not: a call of many small kernels (a normalisation's backward, a convolution with its
    own transforms) read slow by that alone. A call of fewer keeps the graph's many runs at the
    step's clock. 0: off, a short call in its context alone takes it (benchmarks/RESULTS.md,
    "Kernels' figure for calls of many kernels")."""
    small_call_max_ms: float = 0.01
    """A graph-timed call whose kernels took less than this (ms) in the profiled pass takes
    their busy time in profiled runs as timed as its figure, as the step's figure is: a graph
    slot also holds the device's gap before each kernel, a share of a call of a few
    microseconds. Unless it runs on table copies, it also runs on rotating copies of its
    parameters and buffers (``context.parameter_sets``), after its context if it has one: in
    the step each was read once, where K slots on one copy read it warm. Never ``cold``. 0:
    off. On by default since an A/B of the forward zoo (benchmarks/RESULTS.md, "Calls under
    10 us, like with like")."""
    table_kernels_figure: bool = False
    """An embedding lookup on table copies takes the busy time of its kernels in profiled runs
    as timed as its figure, whatever its length (its graph then a check). On many cold copies
    a lookup's graph read under its own kernels, which matched the step; on few copies the
    kernels read fast (benchmarks/RESULTS.md, "DCN's lookups by table copies"). Off until an
    A/B on the hardware the bar is set on says which way."""
    reuse_timing: bool = False
    """Time once the calls that are the same work and cannot depend on values (no integer or
    bool inputs, no value-reading ops): the first of a group is timed, the second checks it,
    the rest copy the first's time (``replay.measure.reuse.TimingReuse``). Off by default."""
    reuse_counts: bool = True
    """Take the FLOP count and the profiled pass (kernel count, device time) of earlier calls
    that are the same work, once two of them agree (``measure.reuse``); False: count and profile
    every call."""
    warm_inputs: bool = False
    """Time each call on inputs just rewritten in place (x * 1), as if its producer had just
    left them in L2; never with ``cold``. Off by default: it overshoots, calls then read faster
    than in situ (benchmarks/RESULTS.md, warm inputs)."""
    eager_only: bool = False
    """Time every call eagerly, also those the step ran under torch.compile (``step_compiled``),
    which are otherwise timed compiled in isolated_ms, their eager time in eager_ms."""
    modes: tuple = ()
    """Also time each call compiled and/or from a CUDA graph: "compile", "cudagraph"."""
    compile_mode: str = "default"
    """torch.compile's mode for the "compile" mode (e.g. "max-autotune-no-cudagraphs")."""
    cold_host_issue: bool = True
    """compile_host_ms taken as the eager call's host_ms plus what compiling adds to its issue
    time when each call is issued right after the step's root run eagerly
    (``compile_cudagraph.cold_issue_ms``), not back to back: a compiled call in a step is issued
    from the caches the rest of the step left, and back-to-back figures put the saving of
    compiling a submodule in place too high (DLRM on an H100: 5 of 6 estimates within +-15 % or
    0.1 ms of the saving measured in place, 1 of 6 back to back; benchmarks/RESULTS.md)."""
    compile_workers: int | None = 0
    """Processes that compile the calls the loop will compile ahead of it, in parallel, so that
    its own compiles hit inductor's caches (``modes.precompile``); None: on a GPU, up to 8 as
    CPUs and memory allow, none on a CPU; 0 (default until measured on a GPU: a 2-core CPU
    gained nothing, benchmarks/RESULTS.md): none."""
    modes_budget_s: float | None = None
    """Seconds the other modes may take over the whole replay; calls after that get the status
    "skipped: ..." in those modes, their eager figures as usual (None: no limit)."""
    backward: bool = False
    """Also replay each call's backward on its captured (else random) output gradients."""
    cpu_windows: int = 2
    """On a CPU, each call timed in this many windows, the later ones after every call's first,
    the fastest kept: a shared machine's slow stretch must then cover a call each time (on a
    2-core VM a 1 ms NanoGPT root read 1.09-1.54 ms from one 20-sample window to the next,
    and the regression gate flagged identical runs). 1: one window (then only the calls
    ``engine.recheck`` picks, noisy or slower than their parent, get a second). Not on a GPU."""
    max_copies: int = 8
    """Most input copies rotated between timed calls (against L2 warmth)."""
    table_copies_max: int = 64
    """Most copies of an embedding lookup's table rotated between its timed calls, one a call
    (in the step each table is read once, after all the others): enough that a table of a few
    MB is out of the L2 when it is read again (``copies.table_copies``)."""
    memory_budget_bytes: int | None = None
    """Skip calls whose estimated footprint exceeds this (default: free device memory)."""
    resume: bool = False
    """Continue a replay that was interrupted: keep finished rows, do the rest."""
    host_runs: int = 5
    """Calls whose host issue time is taken (host_ms: their median); more cost replay wall time
    for a model's large parents, each of which issues for milliseconds."""
    profile_runs: int = 3
    """Calls run under torch.profiler for kernel count and device time."""
    profile_as_timed: bool = True
    """Profile a call in the cache state its timer gives it: the profiled runs rotate over its
    input copies (the last one, which context replay compares outputs with, left alone), and
    a call timed in its context or on table copies is profiled again so, counting its own
    kernels only (``profiler_pass.profile_as_timed``). Its kernels alone then compare with the
    step's as its isolated time does (``miss_cause``). False: every profiled run on copy 0,
    its inputs warm from the run before."""
    count_flops: bool = True
    """Count FLOPs and bytes with cbtrace's formulas (one extra untimed call)."""
    progress: bool | None = None
    """Show progress on stderr: a bar on a terminal, else a line every few seconds (None: on)."""
    timeout_s: float | None = 300.0
    """A call still running after this long ends ``status = timeout`` (None or 0: no limit)."""
    verify_state: bool = True
    """Check that a model rebuilt from the spec matches the captured state digest."""
    trust: bool = False
    """Rebuild the model from the run's own spec even if it names code (file.py:fn, pkg.module:fn)."""
    model_spec: str | None = None
    """Rebuild the model from this spec (as ``cbtrace capture --model``) instead of the run's."""

    def __post_init__(self):
        modes = tuple(m for m in (self.modes or ()) if m != "eager")
        unknown = sorted(set(modes) - set(MODES))
        if unknown:
            raise ValueError(f"modes: unknown {', '.join(unknown)} (modes: eager, "
                             f"{', '.join(MODES)})")
        self.modes = modes
        if self.host_runs < 1 or self.profile_runs < 1 or self.cpu_windows < 1:
            raise ValueError(f"host_runs, profile_runs and cpu_windows must be >= 1, got "
                             f"{self.host_runs}, {self.profile_runs}, {self.cpu_windows}")
        if self.context_kernel_runs < 1:
            raise ValueError(f"context_kernel_runs must be >= 1, got {self.context_kernel_runs}")
        if self.table_copies_max < 1:
            raise ValueError(f"table_copies_max must be >= 1, got {self.table_copies_max}")
        if not self.small_call_max_ms >= 0:
            raise ValueError(f"small_call_max_ms must be >= 0, got {self.small_call_max_ms}")
        if self.kernels_figure_min < 0:
            raise ValueError(f"kernels_figure_min must be >= 0, got {self.kernels_figure_min}")
        if self.context_rewrite not in CONTEXT_REWRITES:
            raise ValueError(f"context_rewrite: {self.context_rewrite!r} is not one of "
                             f"{', '.join(CONTEXT_REWRITES)}")
        bad = {k: getattr(self, k) for k in ("budget_s", "cold_budget_s", "cold_warmup_s",
                                             "cold_settle_tol", "context_max_ms",
                                             "context_activation_max_ms",
                                             "context_memory_max_ms",
                                             "context_kernels_max_ms")
               if getattr(self, k) < 0}
        if self.compile_workers is not None and self.compile_workers < 0:
            bad["compile_workers"] = self.compile_workers
        if self.modes_budget_s is not None and self.modes_budget_s < 0:
            bad["modes_budget_s"] = self.modes_budget_s
        if bad:
            raise ValueError(f"replay settings must be >= 0: {bad}")

    def timing(self) -> TimingConfig:
        """The timers' settings; cold: do_bench's convention, one call per graph for its warm-up
        and run durations, never stopped early."""
        mode = (dict(budget_s=self.cold_budget_s, graph_k=1, warmup_s=self.cold_warmup_s,
                     settle_tol=self.cold_settle_tol, converge_spread=0.0, converge_ci=0.0)
                if self.cold
                else dict(budget_s=self.budget_s, graph_k=self.graph_k,
                          converge_spread=self.converge_spread, converge_ci=self.converge_ci,
                          converge_ci_floor=self.converge_ci_floor))
        return TimingConfig(min_runs=self.min_runs, warmup_runs=self.warmup_runs, **mode)
