"""The state guard's cost per replayed call, a call's own subtree walked whole and every other
parameter by its version counter (``StateGuard.call(module)``, the replay's) against every
parameter walked whole (``call()``), side by side in one process: a model of many small
parameters (600 embedding tables and 400 Linears, as dlrm:large's 600 tables and 200-layer
over-arch), replayed on this machine's CPU with one timing window a call.

    python benchmarks/bench_state_guard.py OUT_DIR
"""
import sys
import time
from pathlib import Path

TABLES, LINEARS = 600, 400


class Wide:
    """Sequential-like: each table looks up its ids, each Linear maps 16 -> 16."""

    @staticmethod
    def build():
        import torch
        from torch import nn

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                torch.manual_seed(0)
                self.tables = nn.ModuleList(nn.EmbeddingBag(100, 16) for _ in range(TABLES))
                self.mlp = nn.Sequential(*[nn.Linear(16, 16) for _ in range(LINEARS)])

            def forward(self, ids, offsets):
                x = sum(t(ids, offsets) for t in self.tables)
                return self.mlp(x)
        return Net().eval()


def main(out_dir: str) -> None:
    import pandas as pd
    import torch

    import cbtrace
    from cbtrace import state
    from cbtrace.rundir.read import read_manifest

    model = Wide.build()
    ids, offsets = torch.randint(0, 100, (64,)), torch.arange(0, 64, 4)
    run = Path(out_dir) / "wide"
    with cbtrace.capture(model, run, trace=False), torch.no_grad():
        model(ids, offsets)
    scoped = state.StateGuard.call
    rows = []
    for how in ("whole", "subtree", "whole", "subtree"):
        state.StateGuard.call = (scoped if how == "subtree"
                                 else lambda self, module=None: scoped(self))
        t0 = time.perf_counter()
        df = cbtrace.replay(run, model=model, budget_s=0.001, min_runs=2, profile_runs=1,
                            cpu_windows=1, progress=False)
        wall = time.perf_counter() - t0
        guard = read_manifest(run).replay.timings_s["state_guard"]
        rows.append({"guard per call": how, "calls": len(df),
                     "parameters": sum(1 for _ in model.parameters()),
                     "state_guard s": round(guard, 2), "ms a call": round(1e3 * guard / len(df), 3),
                     "replay wall s": round(wall, 1)})
    state.StateGuard.call = scoped
    print(pd.DataFrame(rows).to_string(index=False))


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    main(sys.argv[1])
