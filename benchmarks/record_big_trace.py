"""Record a >= 300 MB multi-step NanoGPT-like training trace on a GPU (for bench_trace_load.py).

Uses cbtrace's NanoGPT provider model (GPT-2 small). Runs bf16-autocast training steps under
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
from torch.autograd.profiler import record_function

from cbtrace.plugins.providers.nanogpt import GPT, GPTConfig

BATCH = 8                                   # GPT-2 small (nanoGPT names), seq 1024
WARMUP_STEPS, ACTIVE_STEPS = 3, 60
TARGET_MB = 300
OUT = Path(os.environ.get("OUT", "out"))
PART_BYTES = 15 << 20                       # the device tool brings back files <= 16 MiB


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
    model = GPT(GPTConfig()).cuda()
    VOCAB, BLOCK = model.config.vocab_size, model.config.block_size
    add_ranges(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    idx = torch.randint(0, VOCAB, (BATCH, BLOCK), device="cuda")
    tgt = torch.randint(0, VOCAB, (BATCH, BLOCK), device="cuda")
    json_path = OUT / "nanogpt_train.pt.trace.json"

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            _, loss = model(idx, tgt)
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
    for i in range(0, gz.stat().st_size, PART_BYTES):  # split for transfer: cat parts > file
        with open(gz, "rb") as f:
            f.seek(i)
            (OUT / f"{gz.name}.part{i // PART_BYTES:02d}").write_bytes(f.read(PART_BYTES))
    gz.unlink()
    if mb < TARGET_MB:
        print(f"under {TARGET_MB} MB: raise ACTIVE_STEPS to ~{int(ACTIVE_STEPS * TARGET_MB / mb) + 1}")


if __name__ == "__main__":
    main()
