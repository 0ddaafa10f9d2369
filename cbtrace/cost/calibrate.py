"""Measure the achievable matmul FLOP/s per dtype and the copy bandwidth of this device.

Random (not zero) data; warm-up, then the median of timed runs (nanoGPT ``bench.py`` style).
Copy bandwidth counts bytes read + written. Results are stored by ``peaks.save_calibration``
keyed by ``peaks.device_name(device)``, where ``peak_for(..., calibrated=True)`` finds them.
"""
from __future__ import annotations

import statistics
import time
from datetime import datetime, timezone

import torch

from cbtrace.cost.dtypes import torch_dtype
from cbtrace.cost.peaks import device_name, peak_for, save_calibration
from cbtrace.errors import CbtraceError, one_line
from cbtrace.global_state import GlobalSettings

# Settings. CPU: grow the matrix until one matmul takes MIN_CALL_S; stay within BUDGET_S per figure.
CPU_DTYPES = ("fp32", "bf16")
GPU_DTYPES = ("fp32", "tf32", "bf16", "fp16", "fp8")
CPU_MAX_N, GPU_N = 2048, 8192
CPU_COPY_BYTES, GPU_COPY_BYTES = 32 << 20, 1 << 30
MIN_CALL_S, BUDGET_S, WARMUP, MIN_RUNS, MAX_RUNS = 0.02, 1.0, 2, 5, 50
GPU_CALLS_PER_SAMPLE = 10   # back-to-back calls between one event pair: launch cost amortised


class CalibrationError(CbtraceError):
    """The device to calibrate is unavailable or a measurement failed."""


def _median_seconds(fn, device: str, calls: int = 1) -> float:
    """Warm up, then time ``calls`` back-to-back calls per sample; median per call."""
    for _ in range(WARMUP):
        fn()
    samples, start = [], time.perf_counter()
    while len(samples) < MIN_RUNS or (time.perf_counter() - start < BUDGET_S and len(samples) < MAX_RUNS):
        if device == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            begin.record()
            for _ in range(calls):
                fn()
            end.record()
            end.synchronize()
            samples.append(begin.elapsed_time(end) / 1e3 / calls)
        else:
            t0 = time.perf_counter_ns()
            for _ in range(calls):
                fn()
            samples.append((time.perf_counter_ns() - t0) / 1e9 / calls)
    return statistics.median(samples)


def _matmul_rate(key: str, device: str) -> tuple[float, int]:
    """(FLOP/s, n) of an n x n x n matmul in dtype ``key``."""
    if key == "fp8":
        return _fp8_rate()
    dtype = torch_dtype(key)    # "tf32": float32, run with TF32 allowed by the caller
    if device == "cuda":
        n = GPU_N
    else:
        n = 256
        while n < CPU_MAX_N:   # grow until one call is long enough to time well
            a = torch.randn(n, n, dtype=dtype)
            t0 = time.perf_counter()
            a @ a
            if time.perf_counter() - t0 >= MIN_CALL_S:
                break
            n *= 2
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    seconds = _median_seconds(lambda: torch.mm(a, b, out=out), device,
                              GPU_CALLS_PER_SAMPLE if device == "cuda" else 1)
    return 2 * n ** 3 / seconds, n


def _fp8_rate() -> tuple[float, int]:
    """FP8 (e4m3) matmul via ``torch._scaled_mm``; raises where the GPU or build lacks it."""
    n = GPU_N
    a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn).t()   # mat2 must be column-major
    one = torch.tensor(1.0, device="cuda")
    fn = lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)  # noqa: E731
    return 2 * n ** 3 / _median_seconds(fn, "cuda", GPU_CALLS_PER_SAMPLE), n


def _copy_rate(device: str) -> tuple[float, int]:
    """(bytes/s read + written, bytes per copy) of a large device-to-device copy."""
    nbytes = GPU_COPY_BYTES if device == "cuda" else CPU_COPY_BYTES
    src = torch.randn(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    seconds = _median_seconds(lambda: dst.copy_(src), device, GPU_CALLS_PER_SAMPLE if device == "cuda" else 1)
    return 2 * nbytes / seconds, nbytes


class _Float32Precision:
    """Run fp32 matmuls as TF32 (``tf32=True``) or strict fp32, restoring the settings after."""

    def __init__(self, tf32: bool):
        self.tf32 = tf32

    def __enter__(self):
        self.saved = (torch.backends.cuda.matmul.allow_tf32, torch.get_float32_matmul_precision())
        torch.backends.cuda.matmul.allow_tf32 = self.tf32
        torch.set_float32_matmul_precision("high" if self.tf32 else "highest")

    def __exit__(self, *exc):
        torch.backends.cuda.matmul.allow_tf32 = self.saved[0]
        torch.set_float32_matmul_precision(self.saved[1])


def measure(device: str | None = None) -> dict:
    """Measure this device; returns the calibration entry (not stored). The random data and
    TF32 settings it uses leave the caller's RNG and flags as they were."""
    with GlobalSettings():
        return _measure(device)


def _measure(device: str | None) -> dict:
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda"):
        raise CalibrationError(f"--device {device}: expected cpu or cuda")
    if device == "cuda" and not torch.cuda.is_available():
        raise CalibrationError("cuda: no CUDA device is visible; use --device cpu")
    rates, sizes, skipped = {}, {}, {}
    for key in (GPU_DTYPES if device == "cuda" else CPU_DTYPES):
        try:
            with _Float32Precision(tf32=key == "tf32"):
                rates[key], sizes[key] = _matmul_rate(key, device)
        except (RuntimeError, TypeError, AttributeError) as e:   # e.g. fp8 before Hopper/Ada
            skipped[key] = one_line(e, with_type=False)
    copy_rate, copy_bytes = _copy_rate(device)
    return {
        "device": device, "name": device_name(device),
        "matmul_flops_per_s": rates, "matmul_n": sizes, "skipped": skipped,
        "copy_bytes_per_s": copy_rate, "copy_bytes": copy_bytes,
        "threads": torch.get_num_threads() if device == "cpu" else None,
        "torch": torch.__version__,
        "measured_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def calibrate(device: str | None = None, *, out=None) -> dict:
    """Measure this device and store the entry (default ``~/.cache/cbtrace/calibration.json``).

    Returns the entry, with ``path`` set to the file written.
    """
    entry = measure(device)
    path = save_calibration(entry["name"], entry, out)
    return {**entry, "path": str(path)}


def format_calibration(entry: dict) -> str:
    """A short table of a calibration entry, with the datasheet figure where one is known."""
    lines = [f"{entry['name']} ({entry['device']}), measured {entry['measured_at']}"]
    for key, rate in entry["matmul_flops_per_s"].items():
        sheet = peak_for(entry["name"], key)
        ref = f"   datasheet {sheet.flops_per_s / 1e12:.1f}" if sheet and sheet.flops_per_s else ""
        lines.append(f"  matmul {key:5s} {rate / 1e12:9.3f} TFLOP/s  (n={entry['matmul_n'][key]}){ref}")
    for key, why in entry.get("skipped", {}).items():
        lines.append(f"  matmul {key:5s}   skipped: {why}")
    sheet = peak_for(entry["name"], None)
    ref = f"   datasheet {sheet.bytes_per_s / 1e12:.2f}" if sheet and sheet.bytes_per_s else ""
    lines.append(f"  copy         {entry['copy_bytes_per_s'] / 1e12:9.3f} TB/s (read + write){ref}")
    if entry.get("path"):
        lines.append(f"stored in {entry['path']}")
    return "\n".join(lines)
