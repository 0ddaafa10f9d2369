"""Device probe: why NanoGPT's GELUs run ~6 % slower in the plain step than replayed.

Reads the GELU kernels' durations (torch.profiler) and the SM clock (NVML, sampled every ~1 ms
in a thread) in situations that differ in one thing each:

- ``step after idle``: one forward step after 1 s idle (what the plain step is like);
- ``step, steady``: a step after 1.5 s of back-to-back steps (a clock the step's GEMMs pulled down);
- ``gelu alone``: 50 back-to-back GELUs on block 0's input after 1 s idle (what the graph timer does);
- ``gelu alone, after steps``: the same straight after 1.5 s of back-to-back steps;
- ``c_fc then gelu``: block 0's c_fc and GELU in turn, 50 times (its producer just before it);
- ``gelu after a flush``: a 256 MB write, then the GELU, 50 times (its input out of the L2).

Run: python benchmarks/probes/probe_step_clock.py [SPEC]   (GPU; default nanogpt, batch 8, bf16)
"""
import statistics
import sys
import threading
import time

import torch


class ClockSampler:
    """SM and memory clocks (MHz) every ~1 ms, tagged with the phase set at the time."""

    def __init__(self):
        import pynvml

        pynvml.nvmlInit()
        self.nv = pynvml
        self.handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        self.phase, self.samples, self.stop = "", [], False
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


def kernels(fn, names=("gelu",)):
    """Device µs of the kernels whose name holds one of ``names``, running ``fn`` under the
    profiler."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.device_time for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA
            and any(n in e.name.lower() for n in names)]


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
    model, batch = resolve(spec, options={"batch_size": 8}).model_and_batch(
        "cuda", torch.bfloat16)
    model.eval()
    step = (lambda: model(**batch)) if isinstance(batch, dict) else (lambda: model(*batch))
    gelu = dict(model.named_modules())["transformer.h.0.mlp.gelu"]
    c_fc = dict(model.named_modules())["transformer.h.0.mlp.c_fc"]
    seen = {}
    h = c_fc.register_forward_hook(lambda m, a, out: seen.setdefault("x", a[0].detach().clone()))
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    clocks = ClockSampler()
    rows = []

    def phase(name, before, fn):
        before()
        clocks.phase = name
        got = kernels(fn)
        clocks.phase = ""
        mhz, low, n = clocks.median(name)
        rows.append((name, statistics.median(got), len(got), mhz, low, n))

    idle = lambda: (torch.cuda.synchronize(), time.sleep(1.0))  # noqa: E731
    with torch.no_grad():
        for _ in range(5):
            step()
        h.remove()
        x = seen["x"]
        y = c_fc(x)
        gelu_alone = lambda: [gelu(y) for _ in range(50)]  # noqa: E731
        pairs = lambda: [gelu(c_fc(x)) for _ in range(50)]  # noqa: E731
        flushed = lambda: [(flush.zero_(), gelu(y)) for _ in range(50)]  # noqa: E731
        phase("step after idle", idle, step)
        phase("step, steady", lambda: busy(step, 1.5), lambda: [step() for _ in range(3)])
        phase("gelu alone", idle, gelu_alone)
        phase("gelu alone, after steps", lambda: busy(step, 1.5), gelu_alone)
        phase("c_fc then gelu", idle, pairs)
        phase("gelu after a flush", idle, flushed)
        phase("step after idle (again)", idle, step)
    clocks.stop = True
    print(f"{spec} bf16 batch 8 on {torch.cuda.get_device_name()}: GELU kernels and the SM clock")
    print(f"{'situation':<26}{'GELU med us':>12}{'n':>5}{'SM MHz med':>11}{'min':>6}{'samples':>8}")
    for name, us, n, mhz, low, ns in rows:
        print(f"{name:<26}{us:>12.2f}{n:>5}{mhz:>11.0f}{low:>6.0f}{ns:>8}")


if __name__ == "__main__":
    main(sys.argv[1:])
