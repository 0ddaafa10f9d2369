"""capture + replay + attribution of the capture trace: the isolation error table."""
from __future__ import annotations

from pathlib import Path

from cbtrace import rundir


def join_insitu(run) -> "object":
    """Add insitu_ms and error_pct (= 100 * (isolated / in-situ - 1)) to modules.parquet.

    GPU runs: the call's own device time in the capture trace. CPU runs: its host time in an
    unprofiled repeat of the step (``insitu_host_ms``), when capture recorded one.
    """
    from cbtrace.attribution.attribute import insitu_for_run

    run = Path(run)
    df = rundir.read_modules(run)
    on_gpu = rundir.read_manifest(run).get("device", "cpu").startswith("cuda")
    if not on_gpu and "insitu_host_ms" in df and df["insitu_host_ms"].notna().all():
        df["insitu_ms"] = df["insitu_host_ms"]  # CPU: an unprofiled repeat, not the trace
    else:
        ins = insitu_for_run(run)[["fqn", "call_index", "insitu_ms"]]
        df = df.drop(columns=["insitu_ms"]).merge(ins, on=["fqn", "call_index"], how="left")
    df["error_pct"] = 100.0 * (df["isolated_ms"] / df["insitu_ms"] - 1.0)
    bad = ~(df["insitu_ms"] > 0)
    df.loc[bad, "error_pct"] = float("nan")
    rundir.write_modules(run, df)
    rundir.refresh_checksums(run, rewritten=[rundir.MODULES])
    return df


def error_table(df, *, min_insitu_ms: float = 0.010):
    """Per module class: count, median/min/max error_pct over calls with in-situ >= threshold."""
    d = df[(df["status"] == "ok") & (df["insitu_ms"] >= min_insitu_ms)]
    g = d.groupby("module_type")["error_pct"]
    out = g.agg(["count", "median", "min", "max"])
    out["insitu_ms_median"] = d.groupby("module_type")["insitu_ms"].median()
    return out.sort_values("insitu_ms_median", ascending=False)


def profile(spec: str, out, *, replay_options: dict | None = None, **capture_options):
    """Capture ``spec`` into ``out``, replay it, join in-situ times; returns the modules frame."""
    import cbtrace
    from cbtrace.capture.from_spec import capture_model

    cap = capture_model(spec, Path(out), **capture_options)
    cbtrace.replay(cap.out, **(replay_options or {}))
    return join_insitu(cap.out)
