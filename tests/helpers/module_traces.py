"""Profiler traces made the way a user without cbtrace makes them."""
from pathlib import Path

import torch

from cbtrace.model.spec import resolve


def module_trace(spec: str, out: Path) -> Path:
    """A with_stack profiler trace of the model's CPU forward (``nn.Module: Class_N`` events)."""
    provider = resolve(spec)
    model, batch = provider.model_and_batch("cpu")
    model.eval()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                record_shapes=True, with_stack=True) as prof:
        provider.run(model, batch)
    prof.export_chrome_trace(str(out))
    return out
