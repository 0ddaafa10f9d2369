"""Capture a model built from a provider spec: the library side of ``cbtrace capture``."""
from __future__ import annotations

from pathlib import Path

import torch

from cbtrace.capture.recorder import CaptureConfig, capture
from cbtrace.errors import CaptureError

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
          "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}


def resolve_device(device: str | None) -> str:
    """"auto"/None -> cuda if available else cpu; validates an explicit request."""
    if device in (None, "auto"):
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        kind = torch.device(device).type
    except RuntimeError:
        raise CaptureError(f"--device {device}: not a device (cpu, cuda, cuda:N)") from None
    if kind == "cuda" and not torch.cuda.is_available():
        raise CaptureError(f"--device {device}: CUDA is not available on this machine")
    return device


def stored_spec(spec: str) -> str:
    """The spec as the manifest keeps it: a file.py:fn path made absolute, so replay from
    another directory rebuilds the same model."""
    target, sep, attr = spec.rpartition(":")
    if sep and target.endswith(".py"):
        return f"{Path(target).resolve()}:{attr}"
    return spec


def backward_of(output):
    """A scalar to call backward() on: the loss if the model returns one, else a mean."""
    from cbtrace.nested import flat_tensors

    ts = [t for t in flat_tensors(output) if t.requires_grad and t.is_floating_point()]
    if not ts:
        raise CaptureError("--step train: the model output has no tensor that requires grad")
    scalar = [t for t in ts if t.dim() == 0]
    return scalar[-1] if scalar else ts[0].float().mean()


def run_step(provider, model, batch, step: str):
    out = provider.run(model, batch)
    if step == "train":
        backward_of(out).backward()
    return out


def warm_up(provider, model, batch, step: str, n: int) -> None:
    """Run ``n`` uncaptured steps (lazy init, autotuning), then restore buffers, grads and RNG."""
    if n <= 0:
        return
    buffers = {k: v.detach().clone() for k, v in model.named_buffers()}
    rng = torch.random.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    for _ in range(n):
        run_step(provider, model, batch, step)
    with torch.no_grad():
        for k, v in model.named_buffers():
            v.copy_(buffers[k])
    for p in model.parameters():
        p.grad = None
    torch.random.set_rng_state(rng)
    if cuda_rng is not None:
        torch.cuda.set_rng_state_all(cuda_rng)
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def capture_model(spec: str, out: Path, *, device: str | None = None, dtype: str | None = None,
                  step: str = "forward", warmup: int = 1, seed: int = 0,
                  options: dict | None = None, **capture_options) -> capture:
    """Build the provider's model and batch, warm up, capture one step into ``out``."""
    from cbtrace import rundir
    from cbtrace.errors import CbtraceError, ProviderError
    from cbtrace.model.spec import resolve

    device = resolve_device(device)
    if dtype is not None and dtype not in DTYPES:
        raise CaptureError(f"--dtype {dtype}: expected one of {', '.join(DTYPES)}")
    if Path(out).exists() and any(Path(out).iterdir()):  # before minutes of model building
        rundir.prepare_new_run(out)
    spec = stored_spec(spec)
    provider = resolve(spec, seed=seed, options=options)
    try:
        model, batch = provider.model_and_batch(device, DTYPES.get(dtype))
        model.train(step == "train")
        warm_up(provider, model, batch, step, warmup)
    except CbtraceError:
        raise
    except torch.OutOfMemoryError as e:
        raise CaptureError(f"{spec}: out of memory building or warming up the model "
                           f"({str(e).splitlines()[0][:200]})") from None
    except Exception as e:  # the user's model or options: one line, naming the spec
        raise ProviderError(f"{spec}: failed to build or run the model "
                            f"({type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''})"
                            ) from e
    run_opts = dict(options or {}, device=device, dtype=dtype, step=step, warmup=warmup)
    cfg = CaptureConfig(spec=spec, seed=seed, options=run_opts, **capture_options)
    with capture(model, out, config=cfg) as cap:
        run_step(provider, model, batch, step)
    if not cap.records:
        raise CaptureError(f"{cap.out}: no module call matched --include/--exclude/--max-depth "
                           "(the run directory holds only the trace)")
    if not str(device).startswith("cuda"):
        from cbtrace.capture.host_times import add_host_insitu

        add_host_insitu(cap.out, model, lambda: run_step(provider, model, batch, step))
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return cap
