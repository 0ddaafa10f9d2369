import math
import sys
from pathlib import Path

import click

from cbtrace.plugins.reporters import fmt
from cbtrace.workflows.diff import DiffConfig, check_out_path, diff_runs, write_diff

HEADER = ("module", "call", "match", "regressed", "time A", "time B", "Δ time", "mem A",
          "mem B", "Δ mem", "work changed")


@click.command("diff")
@click.argument("run_a", type=click.Path(exists=True, file_okay=False))
@click.argument("run_b", type=click.Path(exists=True, file_okay=False))
@click.option("--fail-on-regression", is_flag=True, help="exit 1 if any call regressed (for CI)")
@click.option("--out", "out_file", type=click.Path(dir_okay=False), default=None,
              help="write the full table here (.parquet or .csv)")
@click.option("--force", is_flag=True, help="overwrite --out if it exists")
@click.option("--min-time-rel", type=click.FloatRange(min=0), default=DiffConfig.min_time_rel,
              show_default=True, help="smallest relative time change that counts, before the "
                                      "runs' own spread and noise raise it")
@click.option("--min-time-ms", type=click.FloatRange(min=0), default=DiffConfig.min_time_ms,
              show_default=True, help="smallest absolute time change that counts (ms)")
@click.option("--spread-q", type=click.FloatRange(0, 1), default=DiffConfig.spread_q,
              show_default=True,
              help="a time change must also exceed the p90/p10 spread of the call at this "
                   "quantile of both runs' calls")
@click.option("--noise-k", type=click.FloatRange(min=0), default=DiffConfig.noise_k,
              show_default=True,
              help="a time change must also exceed this many robust standard deviations of "
                   "the runs' call-by-call ratios (0: off)")
@click.option("--tail-k", type=click.FloatRange(min=0), default=DiffConfig.tail_k,
              show_default=True,
              help="a time change must also exceed exp(K * d) - 1, d the 90th percentile of "
                   "the leaf calls' |log(B/A)| around its median (0: off)")
@click.option("--min-mem-rel", type=click.FloatRange(min=0), default=DiffConfig.min_mem_rel,
              show_default=True, help="smallest relative peak-memory change that counts")
@click.option("--min-mem-bytes", type=click.IntRange(min=0), default=DiffConfig.min_mem_bytes,
              show_default=True, help="smallest absolute peak-memory change that counts")
@click.option("--min-work-rel", type=click.FloatRange(min=0), default=DiffConfig.min_work_rel,
              show_default=True, help="a work count changed beyond this (relative) and one unit")
@click.option("--icicle/--no-icicle", default=True, show_default=True,
              help="write diff_icicle.html (beside --out, else in RUN_B)")
def command(run_a, run_b, fail_on_regression, out_file, force, min_time_rel, min_time_ms,
            spread_q, noise_k, tail_k, min_mem_rel, min_mem_bytes, min_work_rel, icicle):
    """Compare RUN_B against RUN_A module by module; print the regressions, then the rest.

    Calls are matched by name and call index, else (a renamed module) by tree position.

    \b
    A call regressed, on any device, when in B it
      - does more work: FLOPs, bytes, kernels, parameter or buffer bytes are counted, not
        timed, so any change beyond rounding is the code's (--min-work-rel);
      - holds more peak memory (--min-mem-rel and --min-mem-bytes);
      - is slower: B's p10 above A's p90, by more than the runs' own spread (the p90/p10 of
        the call at --spread-q of both runs' calls), their run-to-run noise (--noise-k),
        how far their worst leaf calls strayed (--tail-k) and --min-time-rel /
        --min-time-ms, once B's times are divided by how much slower all of B ran (the
        median over the calls: the machine's load, not a call's) where that hides a change,
        never where it would make one (a busier A lifts no call of B); and the call tree
        shows it: a change that an enclosing call (for the root: its children) does not show
        is the machine's, dropped.
    Every call that encloses a regressed call regressed with it, up to the root. The same
    tests the other way round are improvements, reported and never failed on.

    Exits 1 with one line when either run holds no replayed figures or no call of B matches
    one of A; with --fail-on-regression, exits 1 when any call regressed.

    Example: cbtrace diff runs/before runs/after --fail-on-regression --out diff.parquet
    """
    if out_file is not None:
        check_out_path(out_file, force=force)  # a one-line error before any work
    df = diff_runs(run_a, run_b, min_time_rel=min_time_rel, min_time_ms=min_time_ms,
                   spread_q=spread_q, noise_k=noise_k, tail_k=tail_k, min_mem_rel=min_mem_rel,
                   min_mem_bytes=min_mem_bytes, min_work_rel=min_work_rel)
    click.echo(regressions_text(df))
    click.echo(summary_text(df))
    if out_file is not None:
        click.echo(f"wrote {write_diff(df, out_file, force=force)}")
    if icicle:
        # imported on use, so that `cbtrace diff --help` imports no numpy
        from cbtrace.plugins.reporters.diff_icicle import write_diff_icicle

        folder = Path(out_file).parent if out_file is not None else Path(run_b)
        click.echo(f"wrote {write_diff_icicle(df, run_a, run_b, folder)}")
    if fail_on_regression and df["regression"].any():
        sys.exit(1)


def _change(delta, rel, fmt_value) -> str:
    if delta is None or delta != delta:  # None or NaN
        return "-"
    sign = "+" if delta >= 0 else "-"
    pct = "" if rel is None or rel != rel else f" ({100 * rel:+.0f}%)"
    return f"{sign}{fmt_value(abs(delta))}{pct}"


def _row(r) -> tuple:
    name = r.fqn or "(root)"
    if r.match == "position" and r.fqn_a != r.fqn_b:
        name = f"{r.fqn_a or '(root)'} -> {name}"
    return (name, r.call_index, r.match, r.regressed, fmt.ms(r.isolated_ms_a),
            fmt.ms(r.isolated_ms_b), _change(r.isolated_ms_delta, r.isolated_ms_rel, fmt.ms),
            fmt.nbytes(r.peak_mem_bytes_a), fmt.nbytes(r.peak_mem_bytes_b),
            _change(r.peak_mem_bytes_delta, r.peak_mem_bytes_rel, fmt.nbytes), _work(r))


def _work(r) -> str:
    """The changed work counts with their change, e.g. "flops +200%, bytes +150%"."""
    cols = [c for c in (r.work_changed or "").split(",") if c]
    return ", ".join(f"{c} {_pct(getattr(r, f'{c}_rel'))}" for c in cols) or "-"


def _pct(rel) -> str:
    return "new" if rel == math.inf else f"{100 * rel:+.0f}%"


def _table(rows: list[tuple]) -> str:
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    text = (0, 1, 2, 3, len(HEADER) - 1)  # left-aligned columns
    lines = ["  ".join(str(c).ljust(w) if i in text else str(c).rjust(w)
                       for i, (c, w) in enumerate(zip(r, widths))).rstrip() for r in rows]
    return "\n".join(lines[:1] + ["  ".join("-" * w for w in widths)] + lines[1:])


def regressions_text(df) -> str:
    """The regressed calls (B against A), in B's call order, as a text table."""
    bad = df[df["regression"]]
    compared = int(df["match"].isin(("name", "position")).sum())
    if bad.empty:
        return f"Regressions: none among {compared} calls compared."
    title = f"Regressions: {len(bad)} of {compared} calls compared (B against A)"
    return title + "\n" + _table([HEADER] + [_row(r) for r in bad.itertuples()])


def summary_text(df) -> str:
    """Counts of the other verdicts and the thresholds applied, a few lines."""
    n = df["verdict"].value_counts().to_dict()
    moved = int((df["match"] == "position").sum())
    a = df.attrs
    noise = math.expm1(a["noise_k"] * a["time_noise_sigma"])
    work = int((df["work_changed"].fillna("") != "").sum())
    lines = [f"improved {n.get('improved', 0)}, unchanged {n.get('unchanged', 0)}, "
             f"no figures {n.get('no figures', 0)}, only in A {n.get('only_a', 0)}, "
             f"only in B {n.get('only_b', 0)}"
             + (f" ({moved} matched by tree position: renamed)" if moved else ""),
             f"work (FLOPs, bytes, kernels, parameter and buffer bytes) changed in {work} "
             f"call(s): counted, so any change beyond rounding counts",
             f"time counts where B's p10 is above A's p90 (taken at most the threshold above "
             f"A's median), B >= {100 * a['time_threshold_rel']:.0f}% slower "
             f"(the largest of {100 * a['min_time_rel']:.0f}%, the calls' own spread "
             f"{100 * a['time_spread_rel']:.0f}%, the run-to-run noise "
             f"{100 * noise:.0f}% over {a['noise_calls']} calls and the worst leaf calls' "
             f"{100 * a['time_tail_rel']:.0f}%) and >= {fmt.ms(a['min_time_ms'])} slower, "
             f"after B's times are divided by {a['time_shift']:.2f} (all of B against all "
             f"of A: the machine's, not a call's) where that hides a change, never where it "
             f"would make one",
             f"memory counts from +{100 * a['min_mem_rel']:.0f}% and "
             f"+{fmt.nbytes(a['min_mem_bytes'])}",
             "a call that encloses a regressed call regressed with it"]
    dropped = df[df["time_contradicted_by"].notna()]
    if len(dropped):
        lines.append(f"{len(dropped)} time change(s) not counted: the call tree did not move "
                     f"with them (time_contradicted_by): "
                     + ", ".join(f or "(root)" for f in dropped["fqn"].head(3))
                     + (" ..." if len(dropped) > 3 else ""))
    noisy = [int(df[f"noisy_{s}"].fillna(False).astype(bool).sum()) for s in "ab"]
    if any(noisy):
        lines.append(f"timed on a busy machine (noisy): {noisy[0]} call(s) in A, {noisy[1]} in B")
    return "\n".join(lines)
