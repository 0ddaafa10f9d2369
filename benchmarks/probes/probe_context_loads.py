"""Context replay's reads of the run: each call's predecessors' inputs read again from the run
for its context, against taken from the copies its predecessors offered as the replay loaded
them (``ContextSource.offer``), side by side in one process on one capture.

Prints per spec and variant: calls, the predecessors whose inputs a context needs, the reads
of the run for contexts, the offered copies taken instead, the seconds spent getting context
inputs and the replay's wall. Context is forced on (on a CPU it is off by default), and
timing is cut short (the reads are the figure, not the times).

    python benchmarks/probes/probe_context_loads.py OUT [SPEC ...] [--device cpu|cuda]
        (SPEC[@batch]: dlrm:large@64 is dlrm:large with batch_size 64)
"""
import argparse
import shutil
import time
from pathlib import Path

import torch

FAST = dict(budget_s=0.001, min_runs=1, count_flops=False, host_runs=1, profile_runs=1,
            progress=False)


def main() -> None:
    from cbtrace.capture.from_spec import capture_model
    from cbtrace.replay.engine import replay
    from cbtrace.replay.measure import context

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("specs", nargs="*", default=["dlrm:large@64", "nanogpt:tiny", "dcn:tiny"])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = ap.parse_args()
    sources = []
    real_offer, real_inputs = context.ContextSource.offer, context.ContextSource._inputs
    seconds = [0.0]

    def timed_inputs(self, rec):
        t0 = time.perf_counter()
        try:
            return real_inputs(self, rec)
        finally:
            seconds[0] += time.perf_counter() - t0

    real_init = context.ContextSource.__init__

    def init(self, *args, **kw):
        real_init(self, *args, **kw)
        sources.append((self, len(self.wanted)))  # wanted drains as calls finish

    context.ContextSource.__init__, context.ContextSource._inputs = init, timed_inputs
    print(f"{'spec':<16} {'offers':<7} {'calls':>6} {'wanted':>7} {'reads':>6} {'offered':>8} "
          f"{'inputs s':>9} {'wall s':>7}")
    for text in a.specs:
        spec, _, batch = text.partition("@")
        run = a.out_dir / text.replace(":", "-").replace("@", "-b")
        shutil.rmtree(run, ignore_errors=True)
        cap = capture_model(spec, run, device=a.device,
                            options={"batch_size": int(batch)} if batch else {})
        for offers in (False, True):
            context.ContextSource.offer = real_offer if offers else (lambda self, rec, x: None)
            seconds[0] = 0.0
            t0 = time.perf_counter()
            df = replay(run, model=cap.model, device=a.device, context=True, **FAST)
            wall = time.perf_counter() - t0
            s, wanted = sources[-1]
            print(f"{text:<16} {'on' if offers else 'off':<7} {len(df):>6} {wanted:>7} "
                  f"{s.loads:>6} {s.offers_used:>8} {seconds[0]:>9.2f} {wall:>7.1f}", flush=True)
            if a.device == "cuda":
                torch.cuda.synchronize()
        del cap
        shutil.rmtree(run, ignore_errors=True)


if __name__ == "__main__":
    main()
