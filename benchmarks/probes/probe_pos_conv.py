"""Device probe: why wav2vec2's positional Conv1d (kernel 128, 16 groups, weight norm) reads
several times longer in kernels under the profiler than between CUDA events or graph replays
(benchmarks/RESULTS.md, sessions 21 and 23): each call's kernels are shown as their sum, span,
busy union and streams (they overlap, or run slower under the profiler).

Feeds ``encoder.pos_conv_embed`` (bf16, wav2vec2-base, batch 8 of 1 s) its input from one forward,
then: each of 6 calls under the profiler, one at a time with a sync between (its kernels' total, its
slowest kernel, and the SM clock from a spin kernel of known cycles right after it: an idle GPU's
clock is several times lower than a busy one's); 6 calls back to back under the profiler; and CUDA
events around one call (synced) against around 10 calls back to back, eager and with
``torch.backends.cudnn.benchmark``.

Run: python benchmarks/probes/probe_pos_conv.py   (GPU; transformers)
"""
import sys
from pathlib import Path

import torch

from cbtrace.device import window_ms

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from zoo import hf_wav2vec2  # noqa: E402


SPIN_CYCLES = 100_000  # ~50 us at 2 GHz


def kernels(fn):
    """[(name, µs, start µs, stream)] of the device kernels ``fn`` ran, from the profiler's
    trace (its events carry no stream)."""
    import json
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = json.load(open(f.name))["traceEvents"]
    return [(e["name"], float(e["dur"]), float(e["ts"]), e.get("args", {}).get("stream", e["tid"]))
            for e in events if e.get("ph") == "X" and e.get("cat") == "kernel"]


def shape(ks) -> str:
    """Sum of the kernels' durations, their span and busy union (ms), and the streams used:
    kernels on several streams overlap, and the sum then exceeds the wall time."""
    if not ks:
        return "no kernels"
    iv = sorted((t, t + d) for _, d, t, _ in ks)
    busy, lo, hi = 0.0, iv[0][0], iv[0][1]
    for a, b in iv[1:]:
        if a > hi:
            busy, lo = busy + hi - lo, a
        hi = max(hi, b)
    busy += hi - lo
    span = max(b for _, b in iv) - iv[0][0]
    streams = sorted({str(k[3]) for k in ks})
    return (f"sum {sum(k[1] for k in ks) / 1e3:.3f} ms, span {span / 1e3:.3f} ms, busy "
            f"{busy / 1e3:.3f} ms, {len(streams)} stream(s) {', '.join(streams)[:40]}")


def events_ms(fn, n):
    """ms a call of ``n`` back to back between CUDA events, from an idle device."""
    torch.cuda.synchronize()
    return window_ms(fn, "cuda", n)


def main():
    model, batch = hf_wav2vec2("real")
    model = model.to("cuda", torch.bfloat16)
    x = batch["input_values"].to("cuda", torch.bfloat16)
    pos = model.encoder.pos_conv_embed
    seen = {}

    def keep(m, a, out):
        seen.setdefault("x", a[0].detach().clone())

    h = pos.register_forward_hook(keep)
    with torch.no_grad():
        model(x)
        h.remove()
        inp = seen["x"]
        call = lambda: pos(inp)  # noqa: E731
        for _ in range(3):
            call()
        torch.cuda.synchronize()
        conv = " ".join(str(pos.conv).split())  # one line: a parametrized conv's repr takes 7
        print(f"pos_conv_embed input {tuple(inp.shape)} {inp.dtype}; conv {conv[:110]}")
        for i in range(6):  # a spin of known cycles right after: the SM clock it ran at
            ks = kernels(lambda: (call(), torch.cuda._sleep(SPIN_CYCLES)))
            spin = [d for n, d, *_ in ks if "spin" in n.lower()]
            ks = [k for k in ks if "spin" not in k[0].lower()]
            top = max(ks, key=lambda k: k[1])
            mhz = f"{SPIN_CYCLES / spin[0]:.0f}" if spin else "?"
            print(f"alone, call {i}: {len(ks)} kernels, {shape(ks)}; slowest "
                  f"{top[1] / 1e3:.3f} ms {top[0][:60]}; SM clock after {mhz} MHz")
        ks = kernels(lambda: [call() for _ in range(6)])
        print(f"6 back to back: {len(ks)} kernels, {shape(ks)} (6 calls)")
        by = {}
        for n, d, *_ in ks:
            by.setdefault(n[:90], []).append(d)
        for n, ds in sorted(by.items(), key=lambda kv: -sum(kv[1]))[:5]:
            print(f"   {len(ds):>3} x {n}: " + " ".join(f"{d / 1e3:.2f}" for d in ds[:8]))
        for bench in (False, True):
            torch.backends.cudnn.benchmark = bench
            for _ in range(3):
                call()
            one = [events_ms(call, 1) for _ in range(5)]
            ten = events_ms(call, 10)
            print(f"cudnn.benchmark={bench}: events, one call synced: "
                  + " ".join(f"{m:.3f}" for m in one) + f" ms; 10 back to back {ten:.3f} ms a call")
        torch.backends.cudnn.benchmark = False


if __name__ == "__main__":
    main()
