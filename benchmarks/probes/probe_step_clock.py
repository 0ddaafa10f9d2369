"""Device probe: whether a call reads faster alone than in the step by the SM clock the step
leaves, or by its cache state. Default: NanoGPT's first GELU (6 % slower in the plain step);
any spec and module fqn (ConvNeXt-T's depthwise convolutions read 10-18 % faster alone).

Reads the call's kernels' durations (torch.profiler) and the SM clock (NVML, sampled every ~1
ms in a thread) in situations that differ in one thing each:

- ``step after idle``: one forward step after 1 s idle (what the plain step is like);
- ``step, steady``: a step after 1.5 s of back-to-back steps (a clock the step's GEMMs pulled down);
- ``alone``: 50 back-to-back calls on the input it had in the step, after 1 s idle (what the
  graph timer does);
- ``alone, after steps``: the same straight after 1.5 s of back-to-back steps;
- ``producer then call`` (NanoGPT's GELU only): c_fc and the GELU in turn, 50 times;
- ``after a flush``: a 256 MB write, then the call, 50 times (its input out of the L2);
- the clock right after the call inside a step (after idle, and steady): a spin a forward hook
  queues there, where the reading after the whole step may have recovered over a light tail.

A call's kernels, in a step as alone, are those between the marker kernels its forward
pre-hook and hook queue (its durations summed per call; markers pair in order, so a module that
calls itself is not for this probe, and kernels of other streams between them count too). The SM clock at the
end of each comes from a spin kernel of known cycles queued right after it (cycles over its
duration), and from NVML (which averages over 1/6 to 1 s).

Run: python benchmarks/probes/probe_step_clock.py [SPEC [FQN]]   (GPU; bf16; NanoGPT at batch 8)
e.g. benchmarks/zoo.py:timm_convnext_tiny stages.2.blocks.0.conv_dw
"""
import statistics
import sys
import threading
import time

import torch


class ClockSampler:
    """The SM clock (MHz, NVML) every ~1 ms, tagged with the phase set at the time; nothing
    where NVML is missing."""

    def __init__(self):
        self.phase, self.samples, self.stop = "", [], False
        try:
            import pynvml

            pynvml.nvmlInit()
        except Exception as e:  # noqa: BLE001 - the spin kernel's clock stands alone
            print(f"no NVML ({e})")
            return
        self.nv = pynvml
        self.handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self):
        nv = self.nv
        while not self.stop:
            sm = nv.nvmlDeviceGetClockInfo(self.handle, nv.NVML_CLOCK_SM)
            self.samples.append((self.phase, sm))
            time.sleep(0.001)

    def median(self, phase):
        got = [sm for p, sm in self.samples if p == phase]
        return (statistics.median(got), min(got), len(got)) if got else (float("nan"),) * 2 + (0,)


SPIN_CYCLES = 100_000  # ~50 us at 2 GHz: the clock from a spin kernel's cycles over its time


def kernels(fn, before, target):
    """(device µs of ``target``'s own kernels, per call: their durations summed; SM MHz at the
    end) running ``before`` then ``fn`` under the profiler. A call's kernels are those between
    the markers (one-cycle spin kernels) its forward pre-hook and hook queue, in a step as
    alone; the clock from a spin kernel of SPIN_CYCLES queued right after ``fn``'s work (its
    cycles over its duration: the clock the SMs ran at then, to ~1 %)."""
    from torch.profiler import ProfilerActivity, profile

    def mark(*_):  # returns None: the call and its output go on as they were
        torch.cuda._sleep(1)

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        # inside: the profiler's start (CUPTI set-up, ms) would idle the GPU between a busy
        # ``before`` and ``fn``, and no sync: ``fn`` queues straight behind it
        before()
        hooks = [target.register_forward_pre_hook(mark), target.register_forward_hook(mark)]
        try:
            fn()
        finally:
            for h in hooks:
                h.remove()
        torch.cuda._sleep(SPIN_CYCLES)
        torch.cuda.synchronize()
    dev = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                 key=lambda e: e.time_range.start)
    spins = [i for i, e in enumerate(dev) if "spin" in e.name.lower()]
    mhz = SPIN_CYCLES / dev[spins[-1]].device_time if spins else float("nan")
    marks = spins[:-1]  # (pre, post) per call of target, then the clock's spin
    if len(marks) % 2:
        print(f"{len(marks)} markers, not pairs: a call's kernels not told apart")
        return [], mhz
    return [sum(e.device_time for e in dev[a + 1:b])
            for a, b in zip(marks[::2], marks[1::2])], mhz


MID_CYCLES = 50_000  # the spin a hook queues right after the call inside a step


def clock_at_call(before, step, target) -> float:
    """SM MHz right after ``target``'s kernels inside one step, run after ``before`` (both under
    the profiler, as ``kernels`` does): a spin of MID_CYCLES queued by a forward hook on the
    step's first call of ``target``, the profile's only spin kernel, its cycles over its
    duration. The clock the step's earlier GEMMs left at that call, where the reading after
    the whole step may have recovered over a light tail."""
    from torch.profiler import ProfilerActivity, profile

    done = []

    def spin_after(module, args, out):  # returns None: the output goes on as it was
        if not done:
            done.append(True)
            torch.cuda._sleep(MID_CYCLES)

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        before()
        h = target.register_forward_hook(spin_after)
        try:
            step()
        finally:
            h.remove()
        torch.cuda.synchronize()
    spins = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
             and "spin" in e.name.lower()]
    return MID_CYCLES / spins[0].device_time if len(spins) == 1 else float("nan")


def kernel_names(fn) -> set:
    """The names of the kernels ``fn`` runs."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return {e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA}


def busy(step, seconds):
    """Back-to-back steps for ``seconds`` without waiting on the device between them."""
    t0 = time.perf_counter()
    n = 0
    while time.perf_counter() - t0 < seconds:
        step()
        n += 1
        if n % 20 == 0:
            torch.cuda.synchronize()  # keep the queue bounded


def main(argv):
    from cbtrace.model.spec import resolve

    spec = argv[0] if argv else "nanogpt"
    fqn = argv[1] if len(argv) > 1 else "transformer.h.0.mlp.gelu"
    # NanoGPT at batch 8; a zoo spec at the size its function defaults to (real)
    options = {"batch_size": 8} if spec == "nanogpt" else {}
    model, batch = resolve(spec, options=options).model_and_batch("cuda", torch.bfloat16)
    model.eval()
    step = (lambda: model(**batch)) if isinstance(batch, dict) else (lambda: model(*batch))
    mods = dict(model.named_modules())
    target = mods[fqn]
    producer = mods.get("transformer.h.0.mlp.c_fc") if fqn == "transformer.h.0.mlp.gelu" else None
    seen = {}

    def keep_input(m, args, kwargs):  # returns None: the call runs on as it would
        if "in" not in seen:
            seen["in"] = ([a.detach().clone() if torch.is_tensor(a) else a for a in args],
                          kwargs)

    h = target.register_forward_pre_hook(keep_input, with_kwargs=True)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    clocks = ClockSampler()
    rows = []

    def phase(name, before, fn):
        got, spin_mhz = kernels(fn, lambda: (before(), setattr(clocks, "phase", name)), target)
        clocks.phase = ""
        mhz, low, n = clocks.median(name)
        rows.append((name, statistics.median(got) if got else float("nan"), len(got), spin_mhz,
                     mhz, low, n))

    idle = lambda: (torch.cuda.synchronize(), time.sleep(1.0))  # noqa: E731
    with torch.no_grad():
        for _ in range(5):
            step()
        h.remove()
        args, kwargs = seen["in"]
        once = lambda: target(*args, **kwargs)  # noqa: E731
        names = kernel_names(once)
        alone = lambda: [once() for _ in range(50)]  # noqa: E731
        flushed = lambda: [(flush.zero_(), once()) for _ in range(50)]  # noqa: E731
        phase("step after idle", idle, step)
        phase("step, steady", lambda: busy(step, 1.5), lambda: [step() for _ in range(3)])
        phase("alone", idle, alone)
        phase("alone, after steps", lambda: busy(step, 1.5), alone)
        if producer is not None:
            # the producer's own input: the target's has its output's width
            x = torch.randn(*args[0].shape[:-1], producer.in_features, device="cuda",
                            dtype=args[0].dtype)
            pairs = lambda: [target(producer(x)) for _ in range(50)]  # noqa: E731
            phase("producer then call", idle, pairs)
        phase("after a flush", idle, flushed)
        phase("step after idle (again)", idle, step)
        at_call = {"step after idle": clock_at_call(idle, step, target),
                   "step, steady": clock_at_call(lambda: busy(step, 1.5), step, target)}
    clocks.stop = True
    size = "batch 8" if options else "its default size"
    print(f"{spec} {fqn} bf16 {size} on {torch.cuda.get_device_name()}: its own kernels per "
          f"call (summed; between markers its hooks queue, in a step as alone) and the SM clock")
    print("SM MHz after: a spin kernel queued right after the phase; NVML: its sampled clock "
          "(averaged over 1/6-1 s by the driver)")
    print(f"{'situation':<26}{'call med us':>14}{'n':>5}{'SM MHz after':>13}{'NVML med':>9}"
          f"{'min':>6}{'samples':>8}")
    for name, us, n, spin_mhz, mhz, low, ns in rows:
        print(f"{name:<26}{us:>14.2f}{n:>5}{spin_mhz:>13.0f}{mhz:>9.0f}{low:>6.0f}{ns:>8}")
    print("SM MHz right after the call inside a step (a hook's spin): " + ", ".join(
        f"{k} {v:.0f}" for k, v in at_call.items()))
    for name in sorted(names):
        print(f"kernel: {name[:160]}")


if __name__ == "__main__":
    main(sys.argv[1:])
