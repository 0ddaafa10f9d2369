"""Record the small traces used by tests/test_attribution*.py and tests/test_amp_attribution.py.

    .venv/bin/python tests/data/record_attribution_traces.py                   # CPU trace, checked in
    python tests/data/record_attribution_traces.py amp-cuda OUT.pt.trace.json.gz   # on a CUDA machine
    .venv/bin/python tests/data/record_attribution_traces.py ranks OUT_DIR          # 2 CPU ranks

Without arguments it writes ``cbtrace_capture_cpu.pt.trace.json.gz``: a tiny MLP training step
under torch.profiler (record_shapes, with_stack), 3 ProfilerStep#N steps, with forward pre/post
hooks that open and close ``cbtrace::<fqn>`` ranges like cbtrace's capture, and a
``cbtrace.copy::<fqn>`` range inside each module's range (like capture copying inputs). ``head``
is called twice per step.

``amp-cuda OUT``: a BERT-like model (``BertLike``: word, position and token-type embeddings,
2 encoder layers with SDPA, an MLM-style head) with fp32 weights, trained under
``torch.autocast("cuda", dtype=torch.bfloat16)`` with AdamW, 1 warm-up and 3 profiled steps
(CPU and CUDA activities, record_shapes, with_stack: ``nn.Module`` events), gzipped: ~0.3 MB.
Its matmuls are large enough (4096 tokens, d=1024) that figures divided by the fp32 peak exceed
1 (issue 12). ``amp_bf16_h200.pt.trace.json.gz`` here was recorded so on an H200 (torch
2.11.0+cu130). tests/test_amp_attribution.py records the same step on the CPU itself
(``record_amp(..., device="cpu")``, small sizes).

``ranks OUT_DIR``: ``rank0.pt.trace.json`` and ``rank1.pt.trace.json``, CPU forward steps of
``Pipeline`` (with_stack), where rank 1's ``stages.1`` does extra matmuls: the straggler of
tests/test_attribute_ranks.py (which records them itself, ``record_ranks``).
"""
import gzip
import shutil
import sys
from pathlib import Path

import torch
from torch import nn
from torch.autograd.profiler import record_function

HERE = Path(__file__).resolve().parent
AMP_CUDA_TRACE = HERE / "amp_bf16_h200.pt.trace.json.gz"  # where tests look for the CUDA trace
# the CUDA trace's model and batch: (B, S) = (8, 512) -> 4096 tokens
CUDA_SIZES = dict(vocab=30522, d=1024, heads=16, ff=4096, layers=2, batch=8, seq=512)


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


# ---------------------------------------------------------------- a BERT-like model for AMP

class Embeddings(nn.Module):
    """BERT's: word + position + token type (all-zero ids, expanded as BERT's buffer is)."""

    def __init__(self, vocab, d, max_pos):
        super().__init__()
        self.word, self.position, self.token_type = (
            nn.Embedding(vocab, d), nn.Embedding(max_pos, d), nn.Embedding(2, d))
        self.norm = nn.LayerNorm(d)
        self.register_buffer("position_ids", torch.arange(max_pos)[None], persistent=False)
        self.register_buffer("token_type_ids", torch.zeros(1, max_pos, dtype=torch.long),
                             persistent=False)

    def forward(self, ids):
        b, s = ids.shape
        types = self.token_type_ids[:, :s].expand(b, s)
        x = self.word(ids) + self.token_type(types) + self.position(self.position_ids[:, :s])
        return self.norm(x)


class Attention(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.out = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = (f(x).view(b, s, self.heads, d // self.heads).transpose(1, 2)
                   for f in (self.q, self.k, self.v))
        y = nn.functional.scaled_dot_product_attention(q, k, v)
        return self.out(y.transpose(1, 2).reshape(b, s, d))


class Layer(nn.Module):
    def __init__(self, d, heads, ff):
        super().__init__()
        self.attn, self.norm1 = Attention(d, heads), nn.LayerNorm(d)
        self.fc1, self.act, self.fc2 = nn.Linear(d, ff), nn.GELU(), nn.Linear(ff, d)
        self.norm2 = nn.LayerNorm(d)

    def forward(self, x):
        x = self.norm1(x + self.attn(x))
        return self.norm2(x + self.fc2(self.act(self.fc1(x))))


class BertLike(nn.Module):
    def __init__(self, vocab=100, d=32, heads=2, ff=64, layers=2, max_pos=512):
        super().__init__()
        self.embeddings = Embeddings(vocab, d, max_pos)
        self.layers = nn.ModuleList(Layer(d, heads, ff) for _ in range(layers))
        self.head = nn.Linear(d, vocab)

    def forward(self, ids):
        x = self.embeddings(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def record_amp(out, *, device="cpu", vocab=100, d=32, heads=2, ff=64, layers=2, batch=2,
               seq=8, steps=2, seed=0) -> Path:
    """One AMP (bf16 autocast, fp32 weights) training step of ``BertLike`` per profiler step,
    after one warm-up step, traced with shapes and module events; writes ``out`` (.json.gz)."""
    torch.manual_seed(seed)
    model = BertLike(vocab, d, heads, ff, layers, max_pos=max(seq, 16)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, vocab, (batch, seq), device=device)
    labels = torch.randint(0, vocab, (batch, seq), device=device)
    acts = [torch.profiler.ProfilerActivity.CPU]
    if torch.device(device).type == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    sched = torch.profiler.schedule(wait=0, warmup=1, active=steps, repeat=1)
    with torch.profiler.profile(activities=acts, schedule=sched, record_shapes=True,
                                with_stack=True) as prof:
        for _ in range(steps + 1):
            with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
                logits = model(ids)
                loss = nn.functional.cross_entropy(logits.view(-1, vocab), labels.view(-1))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            prof.step()
    return _export(prof, Path(out))


def _export(prof, out: Path) -> Path:
    raw = out.with_name(out.name[:-3]) if out.name.endswith(".gz") else out
    prof.export_chrome_trace(str(raw))
    if raw != out:
        with open(raw, "rb") as f, gzip.open(out, "wb", compresslevel=9) as g:
            shutil.copyfileobj(f, g)
        raw.unlink()
    return out


def record_amp_cuda(out=AMP_CUDA_TRACE) -> Path:
    """``record_amp`` on the CUDA device with ``CUDA_SIZES`` (3 profiled steps)."""
    if not torch.cuda.is_available():
        sys.exit("amp-cuda needs a CUDA device")
    return record_amp(out, device="cuda", steps=3, **CUDA_SIZES)


# ---------------------------------------------------------------- ranks with a straggler

class Stage(nn.Module):
    """A Linear, then ``extra`` rounds of real work (matmul + tanh): the planted straggler."""

    def __init__(self, d, extra=0):
        super().__init__()
        self.fc, self.extra = nn.Linear(d, d), extra
        self.register_buffer("w", torch.eye(d))

    def forward(self, x):
        y = self.fc(x)
        for _ in range(self.extra):
            y = torch.tanh(y @ self.w)
        return y


class Pipeline(nn.Module):
    def __init__(self, d=64, slow=0):
        super().__init__()
        self.embed = nn.Linear(d, d)
        self.stages = nn.Sequential(Stage(d), Stage(d, extra=slow), Stage(d))
        self.head = nn.Linear(d, d)

    def forward(self, x):
        return self.head(self.stages(self.embed(x)))


def straggler_model(d=64, batch=32, slow=0):
    """The ``Pipeline`` and a batch: ``--model tests/data/record_attribution_traces.py:straggler_model``."""
    return Pipeline(d, slow), (torch.randn(batch, d),)


def record_ranks(out_dir, *, ranks=2, slow_rank=1, slow=50, steps=3) -> list[Path]:
    """``rank<R>.pt.trace.json`` per rank: ``steps`` forward steps of ``Pipeline`` on the CPU
    (with_stack: ``nn.Module`` events; the rank in the file name), where ``stages.1`` of
    ``slow_rank`` does ``slow`` extra matmuls per call: a rank whose one module is slower."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for r in range(ranks):
        torch.manual_seed(0)
        model, (x,) = straggler_model(slow=slow if r == slow_rank else 0)
        sched = torch.profiler.schedule(wait=0, warmup=1, active=steps, repeat=1)
        with torch.no_grad(), torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU], schedule=sched,
                record_shapes=True, with_stack=True) as prof:
            for _ in range(steps + 1):
                model(x)
                prof.step()
        paths.append(_export(prof, out_dir / f"rank{r}.pt.trace.json"))
    return paths


# ---------------------------------------------------------------- the checked-in CPU trace

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
    out = HERE / "cbtrace_capture_cpu.pt.trace.json.gz"
    sched = torch.profiler.schedule(wait=0, warmup=1, active=3, repeat=1)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], schedule=sched,
                                record_shapes=True, with_stack=True) as prof:
        for _ in range(4):
            opt.zero_grad()
            model(idx).square().mean().backward()
            opt.step()
            prof.step()
    print("wrote", _export(prof, out))


if __name__ == "__main__":
    if sys.argv[1:2] == ["amp-cuda"]:
        print("wrote", record_amp_cuda(*sys.argv[2:3]))
    elif sys.argv[1:2] == ["ranks"] and len(sys.argv) == 3:
        print("wrote", *record_ranks(sys.argv[2]))
    elif len(sys.argv) > 1:
        sys.exit(__doc__)
    else:
        main()
