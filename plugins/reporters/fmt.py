"""Human-readable figures for labels, tooltips and tables; pure functions, "-" for missing."""
from __future__ import annotations

import math

MISSING = "-"


def _missing(v) -> bool:
    return v is None or (isinstance(v, float) and math.isnan(v))


def ms(v) -> str:
    """Milliseconds with 3 significant digits, switching to µs below 0.1 ms."""
    if _missing(v):
        return MISSING
    if abs(v) < 0.1:
        return f"{v * 1000:.3g} µs"
    return f"{v:.3g} ms" if abs(v) < 1000 else f"{v:,.0f} ms"


def si(v, unit: str, base: int = 1000) -> str:
    """1.23e12 -> "1.23 T<unit>" (base 1000) or with base 1024 -> "GiB"-style prefixes."""
    if _missing(v):
        return MISSING
    prefixes = ["", "K", "M", "G", "T", "P", "E"]
    i = 0
    x = float(v)
    while abs(x) >= base and i < len(prefixes) - 1:
        x /= base
        i += 1
    p = prefixes[i] + ("i" if base == 1024 and i else "")
    return f"{x:.3g} {p}{unit}"


def flops(v) -> str:
    return si(v, "FLOP")


def nbytes(v) -> str:
    return si(v, "B", 1024)


def pct(v, *, fraction: bool = True) -> str:
    """A fraction (0.43) or a percentage (43.0, ``fraction=False``) as "43.0%"."""
    if _missing(v):
        return MISSING
    return f"{(100 * v if fraction else v):.1f}%"


def count(v) -> str:
    return MISSING if _missing(v) else f"{int(v):,}"


def text(v) -> str:
    return MISSING if _missing(v) or v == "" else str(v)
