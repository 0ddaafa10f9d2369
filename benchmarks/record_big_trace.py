"""Record a >= 300 MB multi-step NanoGPT-like training trace on a GPU (for bench_trace_load.py).

Self-contained: a small GPT is written inline. Runs bf16-autocast training steps under
torch.profiler (CPU + CUDA, record_shapes, with_stack) with cbtrace-like ``cbtrace::<fqn>``
ranges opened by forward hooks, and writes the trace gzip-compressed under $OUT (or ./out).

    OUT=/tmp/out python benchmarks/record_big_trace.py

Settings below; raise ACTIVE_STEPS if the printed JSON size is under TARGET_MB.
"""
import gzip
import os
import shutil
import time
from pathlib import Path

import torch
from torch import nn
from torch.autograd.profiler import record_function
from torch.nn import functional as F

N_LAYER, N_HEAD, N_EMBD, BLOCK, VOCAB, BATCH = 12, 12, 768, 1024, 50304, 8  # GPT-2 small
WARMUP_STEPS, ACTIVE_STEPS = 3, 40
TARGET_MB = 300
OUT = Path(os.environ.get("OUT", "out"))


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_attn, self.c_proj = nn.Linear(N_EMBD, 3 * N_EMBD), nn.Linear(N_EMBD, N_EMBD)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(N_EMBD, dim=2)
        q, k, v = (t.view(B, T, N_HEAD, C // N_HEAD).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_fc, self.gelu, self.c_proj = nn.Linear(N_EMBD, 4 * N_EMBD), nn.GELU(), nn.Linear(4 * N_EMBD, N_EMBD)

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1, self.attn, self.ln_2, self.mlp = nn.LayerNorm(N_EMBD), Attention(), nn.LayerNorm(N_EMBD), MLP()

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, N_EMBD), nn.Embedding(BLOCK, N_EMBD)
        self.h = nn.ModuleList(Block() for _ in range(N_LAYER))
        self.ln_f = nn.LayerNorm(N_EMBD)
        self.lm_head = nn.Linear(N_EMBD, VOCAB, bias=False)
        self.wte.weight = self.lm_head.weight  # tied, as in nanoGPT

    def forward(self, idx, targets):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def add_ranges(model):
    """cbtrace-like record_function("cbtrace::<fqn>") ranges around every module call."""
    stack = []
    for fqn, m in model.named_modules():
        m.register_forward_pre_hook(lambda mod, a, fqn=fqn: stack.append(_enter(f"cbtrace::{fqn}")))
        m.register_forward_hook(lambda mod, a, o: stack.pop().__exit__(None, None, None))


def _enter(name):
    rf = record_function(name)
    rf.__enter__()
    return rf


def main():
    assert torch.cuda.is_available(), "needs a CUDA GPU"
    OUT.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = GPT().cuda()
    add_ranges(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    idx = torch.randint(0, VOCAB, (BATCH, BLOCK), device="cuda")
    tgt = torch.randint(0, VOCAB, (BATCH, BLOCK), device="cuda")
    json_path = OUT / "nanogpt_train.pt.trace.json"

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(idx, tgt)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(WARMUP_STEPS):
        step()
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    sched = torch.profiler.schedule(wait=0, warmup=1, active=ACTIVE_STEPS, repeat=1)
    t = time.time()
    with torch.profiler.profile(activities=acts, schedule=sched, record_shapes=True, with_stack=True,
                                on_trace_ready=lambda p: p.export_chrome_trace(str(json_path))) as prof:
        for _ in range(ACTIVE_STEPS + 1):
            step()
            prof.step()
    mb = json_path.stat().st_size / 1e6
    with open(json_path, "rb") as f, gzip.open(str(json_path) + ".gz", "wb", compresslevel=6) as g:
        shutil.copyfileobj(f, g, 16 << 20)
    json_path.unlink()
    gz = Path(str(json_path) + ".gz")
    print(f"{ACTIVE_STEPS} steps: {mb:.0f} MB json -> {gz} ({gz.stat().st_size / 1e6:.0f} MB gz) "
          f"in {time.time() - t:.0f} s")
    if mb < TARGET_MB:
        print(f"under {TARGET_MB} MB: raise ACTIVE_STEPS to ~{int(ACTIVE_STEPS * TARGET_MB / mb) + 1}")


if __name__ == "__main__":
    main()
