"""After replay: aggregate skipped parents from children, residuals, MFU/MBU/bound (forward and
backward), and each call's saving in its fastest mode."""
from __future__ import annotations

from cbtrace.cost import metrics
from cbtrace.cost.compute_dtype import dominant_dtype
from cbtrace.cost.peaks import PeakLookup
from cbtrace.calltree import CallTree
from cbtrace.replay.modes.opportunity import add_opportunities


def finalize(records, *, device_name: str) -> None:
    """Fill derived fields of replayed records in place."""
    by_id = {r.call_id: r for r in records}
    tree = CallTree({r.call_id: r.parent_call_id for r in records})
    for cid in tree.post_order:  # children first: a skipped parent sums their final figures
        rec, children = by_id[cid], [by_id[k] for k in tree.children[cid]]
        if rec.status == "skipped" and children:
            aggregate_from_children(rec, children)
        elif rec.status == "ok" and children:
            rec.residual_ms = metrics.residual(rec.isolated_ms, [c.isolated_ms for c in children])
            for c in children:  # a child cannot take longer than the call that runs it
                if c.isolated_ms is not None and rec.isolated_ms is not None and (
                        c.isolated_ms > rec.isolated_ms):
                    c.noisy = True
    peaks = PeakLookup(device_name)
    for rec in records:
        add_utilisation(rec, device_name, peaks)
        add_backward_utilisation(rec, device_name, peaks)
    add_opportunities(records)  # eager step cost, best mode, speedup, saving (modes/opportunity.py)


def aggregate_from_children(rec, children) -> None:
    """A skipped parent takes the sum of its children's figures (only if all were measured)."""
    if any(c.isolated_ms is None for c in children):
        return
    rec.aggregated = True
    rec.timer = "aggregated"
    rec.isolated_ms = sum(c.isolated_ms for c in children)
    for name in ("isolated_ms_p10", "isolated_ms_p90", "device_ms", "flops", "flops_executed",
                 "bytes", "kernel_count", "unknown_ops"):
        vals = [getattr(c, name) for c in children]
        if all(v is not None for v in vals):
            setattr(rec, name, sum(vals))
    mems = [c.peak_mem_bytes for c in children if c.peak_mem_bytes is not None]
    rec.peak_mem_bytes = max(mems) if mems else None
    rec.compute_dtype = dominant_dtype((c.compute_dtype, c.flops or 0.0, c.bytes or 0.0)
                                       for c in children)


def add_utilisation(rec, device_name: str, peaks: PeakLookup | None = None) -> None:
    """mfu/hfu/mbu against the peak of ``PeakLookup``'s rule (datasheet, else calibrated),
    mfu/mbu_calibrated against the calibrated peak, and the bound.
    ``peaks``: a ``PeakLookup(device_name)`` shared by the records of one replay."""
    if not rec.isolated_ms:
        return
    peaks = peaks or PeakLookup(device_name)
    seconds = rec.isolated_ms / 1e3
    peak = peaks(rec.compute_dtype)
    for p, suffix in ((peak, ""), (peaks.calibrated(rec.compute_dtype), "_calibrated")):
        if p is None:
            continue
        if p.flops_per_s and rec.flops is not None:
            setattr(rec, "mfu" + suffix, metrics.mfu(rec.flops, seconds, p.flops_per_s))
            if not suffix and rec.flops_executed is not None:
                rec.hfu = metrics.hfu(rec.flops_executed, seconds, p.flops_per_s)
        if p.bytes_per_s and rec.bytes is not None:
            setattr(rec, "mbu" + suffix, metrics.mbu(rec.bytes, seconds, p.bytes_per_s))
    rec.figures_suspect = metrics.suspect(rec.mfu, rec.hfu, rec.mbu)
    if peak is not None and peak.flops_per_s and peak.bytes_per_s:
        host, device = host_and_device_s(rec)
        rec.bound = metrics.bound(rec.flops or 0.0, rec.bytes or 0.0, seconds, peak.flops_per_s,
                                  peak.bytes_per_s, kernel_count=rec.kernel_count or 0,
                                  host_s=host, device_s=device)


def host_and_device_s(rec) -> tuple[float | None, float | None]:
    """(host issue time, device time) of a call, in s, for the "host" bound: host_ms against
    isolated_ms, or against device_ms (the profiled pass) where the call was timed back to
    back, its isolated figure then holding the host's own time. Not the synchronised eager
    wall time: that carries a fixed sync latency for every call."""
    if rec.host_ms is None:
        return None, None
    device = rec.device_ms if rec.timer in metrics.SPAN_TIMERS else rec.isolated_ms
    return (rec.host_ms / 1e3, device / 1e3) if device else (None, None)


def add_backward_utilisation(rec, device_name: str, peaks: PeakLookup | None = None) -> None:
    """bwd_mfu/bwd_mbu: the backward's counted FLOPs and bytes over its time, against the peak
    of the dtype its FLOPs ran in (``PeakLookup``'s rule)."""
    if not rec.bwd_ms:
        return
    peak = (peaks or PeakLookup(device_name))(rec.bwd_compute_dtype or rec.compute_dtype)
    if peak is None:
        return
    seconds = rec.bwd_ms / 1e3
    if peak.flops_per_s and rec.bwd_flops is not None:
        rec.bwd_mfu = metrics.mfu(rec.bwd_flops, seconds, peak.flops_per_s)
    if peak.bytes_per_s and rec.bwd_bytes is not None:
        rec.bwd_mbu = metrics.mbu(rec.bwd_bytes, seconds, peak.bytes_per_s)
