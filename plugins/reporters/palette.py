"""Colours of the icicle: MFU (blue), MBU (orange), bound, or speedup; pure functions of numbers.

A module is coloured by the utilisation of the resource that binds it
(``cbtrace.cost.metrics.binding_utilisation``): MFU when it has FLOPs (and is not memory-bound),
MBU when it has no FLOPs (ReLU, dropout, a copy) or is memory-bound (a LayerNorm), so an
elementwise op shows how much of the bandwidth it used instead of a flat "bad" colour at 0 % MFU.
Both scales are linear from 0 to 100 % of the datasheet peak (values above are clamped).
The speedup scheme (runs replayed with ``--modes``) is green, deeper with the speedup of the
call's fastest mode over its eager step cost, on a log scale from 1x to ``SPEEDUP_MAX``.
"""
from __future__ import annotations

import math

from cbtrace.cost.metrics import binding_utilisation

MFU_SCALE = ("#e3ecfb", "#0b3d91")   # 0 % -> 100 % MFU
MBU_SCALE = ("#fdebd6", "#a84300")   # 0 % -> 100 % MBU
BOUND_COLORS = {                      # Tableau 10: blue, orange, purple, red
    "compute": "#4c78a8",
    "memory": "#f58518",
    "launch": "#b279a2",
    "host": "#e45756",
}
SPEEDUP_SCALE = ("#f1f8ee", "#11632b")  # 1x (eager is fastest) -> SPEEDUP_MAX and above
SPEEDUP_MAX = 4.0
NO_FIGURES = "#d4d4d4"                # not replayed, skipped or failed
RESIDUAL = "#ececec"                  # a parent's own kernels ("(self)" node)


def _rgb(hex_color: str) -> tuple[int, int, int]:
    h = hex_color.lstrip("#")
    return int(h[0:2], 16), int(h[2:4], 16), int(h[4:6], 16)


def lerp_color(lo: str, hi: str, t: float) -> str:
    """Linear blend of two "#rrggbb" colours; ``t`` is clamped to [0, 1]."""
    t = min(max(t, 0.0), 1.0)
    a, b = _rgb(lo), _rgb(hi)
    return "#" + "".join(f"{round(x + (y - x) * t):02x}" for x, y in zip(a, b))


def metric_color(mfu: float | None, mbu: float | None, has_flops: bool,
                 bound: str | None = None) -> tuple[str, str]:
    """(colour, label) for the efficiency scheme: the utilisation that binds the module
    (``binding_utilisation``, the Perfetto annotation's rule too) on its scale."""
    metric, value = binding_utilisation(mfu, mbu, has_flops, bound)
    if metric is None:
        return NO_FIGURES, ""
    scale = MFU_SCALE if metric == "mfu" else MBU_SCALE
    return lerp_color(*scale, value), f"{metric.upper()} {100 * value:.1f}%"


def speedup_color(speedup: float | None, best_mode: str | None = None) -> tuple[str, str]:
    """(colour, label) for the speedup scheme: log2(speedup) / log2(SPEEDUP_MAX) on its
    scale; no figures without a speedup."""
    if speedup is None or not math.isfinite(speedup) or speedup <= 0:
        return NO_FIGURES, ""
    t = math.log(max(speedup, 1.0)) / math.log(SPEEDUP_MAX)
    label = f"{speedup:.2f}x {best_mode}" if best_mode and best_mode != "eager" else "eager best"
    return lerp_color(*SPEEDUP_SCALE, t), label


def bound_color(bound: str | None) -> str:
    return BOUND_COLORS.get(bound or "", NO_FIGURES)


def text_color(background: str) -> str:
    """Black or white, whichever reads better on ``background`` (WCAG relative luminance)."""
    def lin(c: int) -> float:
        c = c / 255
        return c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4

    r, g, b = (lin(c) for c in _rgb(background))
    lum = 0.2126 * r + 0.7152 * g + 0.0722 * b
    return "#000000" if lum > 0.179 else "#ffffff"
