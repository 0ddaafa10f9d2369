"""Inputs too large to keep: statistics at capture, deterministic synthesis at load.

Integers keep their observed [min, max] (embedding ids stay valid), floats their mean and
std over finite values, bools their fraction of True; complex numbers use the float rule
on the real and imaginary parts. Synthesis draws from a generator with a fixed seed.
"""
from __future__ import annotations

import math

import torch

SEED = 1234567  # + chunk id, so that two synthesized tensors of a run differ
INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64,
              torch.uint8, torch.uint16, torch.uint32, torch.uint64)


def _float_stats(x: torch.Tensor) -> torch.Tensor:
    """[finite count, sum, sum of squares] in float64; on x's device, no host sync."""
    if x.dtype not in (torch.float32, torch.float64):
        x = x.to(torch.float32)
    finite = torch.isfinite(x)
    xs = torch.where(finite, x, 0)
    norm = torch.linalg.vector_norm(xs.reshape(-1), dtype=torch.float64)
    return torch.stack([finite.sum(dtype=torch.float64), xs.sum(dtype=torch.float64), norm * norm])


def stats_of(t: torch.Tensor) -> tuple[str, torch.Tensor]:
    """(kind, small float64/int64 tensor on t's device); raises TypeError for other dtypes."""
    with torch.no_grad():
        if t.dtype == torch.bool:
            return "bool", t.sum(dtype=torch.float64).reshape(1)
        if t.is_complex():
            z = t.to(torch.complex128)
            return "complex", torch.cat([_float_stats(z.real), _float_stats(z.imag)])
        if t.is_floating_point():
            return "float", _float_stats(t)
        if t.dtype in INT_DTYPES:
            lo, hi = torch.aminmax(t if t.dtype == torch.int64 else t.to(torch.int64))
            return "int", torch.stack([lo, hi])
    raise TypeError(f"no statistics for {t.dtype}")


def _mean_std(n: float, s1: float, s2: float) -> tuple[float, float]:
    if n <= 0:
        return 0.0, 0.0
    mean = s1 / n
    return mean, math.sqrt(max(s2 / n - mean * mean, 0.0))


def stats_doc(kind: str, values: list, numel: int) -> dict:
    """The JSON-able record of ``stats_of``'s values (after they reach the host)."""
    if kind == "bool":
        return {"kind": kind, "p": values[0] / numel if numel else 0.0}
    if kind == "int":
        return {"kind": kind, "min": int(values[0]), "max": int(values[1])}
    mean, std = _mean_std(*values[:3])
    doc = {"kind": kind, "mean": mean, "std": std, "finite": values[0] / numel if numel else 1.0}
    if kind == "complex":
        doc["mean_imag"], doc["std_imag"] = _mean_std(*values[3:6])
    return doc


def _normal(n, mean, std, dtype, g, device):
    work = torch.float64 if dtype in (torch.float64, torch.complex128) else torch.float32
    x = torch.randn(n, generator=g, device=device, dtype=work) * std + mean
    if dtype.is_floating_point:
        try:
            info = torch.finfo(dtype)
            x = x.clamp(info.min, info.max)
        except TypeError:
            pass
    return x


def synthesize(doc: dict, dtype: torch.dtype, n: int, device, seed: int) -> torch.Tensor:
    """A 1-D tensor of ``n`` elements of ``dtype`` drawn to match ``doc`` (deterministic)."""
    g = torch.Generator(device=device).manual_seed(seed)
    kind = doc["kind"]
    if kind == "bool":
        return torch.rand(n, generator=g, device=device) < doc["p"]
    if kind == "int":
        lo, hi = doc["min"], min(doc["max"], 2**63 - 2)
        if hi <= lo:
            return torch.full((n,), lo, dtype=torch.int64, device=device).to(dtype)
        return torch.randint(lo, hi + 1, (n,), generator=g, device=device,
                             dtype=torch.int64).to(dtype)
    if kind == "complex":
        re = _normal(n, doc["mean"], doc["std"], dtype, g, device)
        im = _normal(n, doc["mean_imag"], doc["std_imag"], dtype, g, device)
        return torch.complex(re, im).to(dtype)
    return _normal(n, doc["mean"], doc["std"], dtype, g, device).to(dtype)
