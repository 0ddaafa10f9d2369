"""Record the small CPU traces used by tests/test_attribution*.py (run once, output checked in).

    .venv/bin/python tests/data/record_attribution_traces.py

Writes ``cbtrace_capture_cpu.pt.trace.json.gz``: a tiny MLP training step under torch.profiler
(record_shapes, with_stack), 3 ProfilerStep#N steps, with forward pre/post hooks that open and
close ``cbtrace::<fqn>`` ranges like cbtrace's capture, and a ``cbtrace.copy::<fqn>`` range
inside each module's range (like capture copying inputs). ``head`` is called twice per step.
"""
from pathlib import Path

import torch
from torch import nn
from torch.autograd.profiler import record_function

HERE = Path(__file__).resolve().parent


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(d, 2 * d), nn.ReLU(), nn.Linear(2 * d, d)
        self.norm = nn.LayerNorm(d)

    def forward(self, x):
        return self.norm(x + self.fc2(self.act(self.fc1(x))))


class Tiny(nn.Module):
    def __init__(self, vocab=50, d=32):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.Sequential(Block(d), Block(d))
        self.head = nn.Linear(d, d)

    def forward(self, idx):
        x = self.blocks(self.emb(idx))
        return self.head(self.head(x))  # head twice: call_index 0 and 1


def add_range_hooks(model):
    """Forward pre/post hooks that open/close record_function ranges, as cbtrace's capture does."""
    open_ranges = {}

    def pre(fqn):
        def hook(mod, args):
            rf = record_function(f"cbtrace::{fqn}")
            rf.__enter__()
            open_ranges.setdefault(fqn, []).append(rf)
            with record_function(f"cbtrace.copy::{fqn}"):
                [a.clone() for a in args if isinstance(a, torch.Tensor)]
        return hook

    def post(fqn):
        def hook(mod, args, out):
            open_ranges[fqn].pop().__exit__(None, None, None)
        return hook

    for fqn, m in model.named_modules():
        m.register_forward_pre_hook(pre(fqn))
        m.register_forward_hook(post(fqn))


def main():
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = Tiny()
    add_range_hooks(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    idx = torch.randint(0, 50, (4, 8))
    out = HERE / "cbtrace_capture_cpu.pt.trace.json"
    sched = torch.profiler.schedule(wait=0, warmup=1, active=3, repeat=1)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], schedule=sched,
                                record_shapes=True, with_stack=True) as prof:
        for _ in range(4):
            opt.zero_grad()
            model(idx).square().mean().backward()
            opt.step()
            prof.step()
    prof.export_chrome_trace(str(out))
    import gzip, shutil
    with open(out, "rb") as f, gzip.open(str(out) + ".gz", "wb", compresslevel=9) as g:
        shutil.copyfileobj(f, g)
    out.unlink()
    print("wrote", str(out) + ".gz")


if __name__ == "__main__":
    main()
