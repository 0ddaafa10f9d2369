import math
import sys

import click

from cbtrace.workflows.diff import DiffConfig

HEADER = ("module", "call", "match", "regressed", "time A", "time B", "Δ time", "mem A",
          "mem B", "Δ mem")


@click.command("diff")
@click.argument("run_a", type=click.Path(exists=True, file_okay=False))
@click.argument("run_b", type=click.Path(exists=True, file_okay=False))
@click.option("--fail-on-regression", is_flag=True, help="exit 1 if any call regressed (for CI)")
@click.option("--out", "out_file", type=click.Path(dir_okay=False), default=None,
              help="write the full table here (.parquet or .csv)")
@click.option("--force", is_flag=True, help="overwrite --out if it exists")
@click.option("--min-time-rel", type=click.FloatRange(min=0), default=None,
              help="smallest relative time change that counts (default: 0.05 for runs "
                   "replayed on a GPU, 1.5 where one was replayed on a CPU)")
@click.option("--min-time-ms", type=click.FloatRange(min=0), default=None,
              help="smallest absolute time change that counts (ms; default: 0.001 on a GPU, "
                   "0.05 on a CPU)")
@click.option("--min-mem-rel", type=click.FloatRange(min=0), default=DiffConfig.min_mem_rel,
              show_default=True, help="smallest relative peak-memory change that counts")
@click.option("--min-mem-bytes", type=click.IntRange(min=0), default=DiffConfig.min_mem_bytes,
              show_default=True, help="smallest absolute peak-memory change that counts")
@click.option("--noise-k", type=click.FloatRange(min=0), default=DiffConfig.noise_k,
              show_default=True,
              help="a time change must also exceed this many robust standard deviations of "
                   "the runs' call-by-call ratios (0: off)")
@click.option("--icicle/--no-icicle", default=True, show_default=True,
              help="write diff_icicle.html (beside --out, else in RUN_B)")
def command(run_a, run_b, fail_on_regression, out_file, force, min_time_rel, min_time_ms,
            min_mem_rel, min_mem_bytes, noise_k, icicle):
    """Compare RUN_B against RUN_A module by module; print the regressions, then the rest.

    Calls are matched by name and call index, else (a renamed module) by tree position. A
    call regressed when B is slower beyond both runs' p10-p90 spread and the run-to-run noise,
    or holds more peak memory, by more than the thresholds.
    Example: cbtrace diff runs/before runs/after --fail-on-regression --out diff.parquet
    """
    from pathlib import Path

    from cbtrace.workflows.diff import check_out_path, diff_runs, write_diff

    if out_file is not None:
        check_out_path(out_file, force=force)  # a one-line error before any work
    df = diff_runs(run_a, run_b, min_time_rel=min_time_rel, min_time_ms=min_time_ms,
                   min_mem_rel=min_mem_rel, min_mem_bytes=min_mem_bytes, noise_k=noise_k)
    click.echo(regressions_text(df))
    click.echo(summary_text(df))
    if out_file is not None:
        click.echo(f"wrote {write_diff(df, out_file, force=force)}")
    if icicle:
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
    from cbtrace.plugins.reporters import fmt

    name = r.fqn or "(root)"
    if r.match == "position" and r.fqn_a != r.fqn_b:
        name = f"{r.fqn_a or '(root)'} -> {name}"
    return (name, r.call_index, r.match, r.regressed, fmt.ms(r.isolated_ms_a),
            fmt.ms(r.isolated_ms_b), _change(r.isolated_ms_delta, r.isolated_ms_rel, fmt.ms),
            fmt.nbytes(r.peak_mem_bytes_a), fmt.nbytes(r.peak_mem_bytes_b),
            _change(r.peak_mem_bytes_delta, r.peak_mem_bytes_rel, fmt.nbytes))


def _table(rows: list[tuple]) -> str:
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(str(c).ljust(w) if i < 4 else str(c).rjust(w)
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
    from cbtrace.plugins.reporters import fmt

    n = df["verdict"].value_counts().to_dict()
    moved = int((df["match"] == "position").sum())
    a = df.attrs
    noise = math.expm1(a["noise_k"] * a["time_noise_sigma"])
    lines = [f"improved {n.get('improved', 0)}, unchanged {n.get('unchanged', 0)}, "
             f"no figures {n.get('no figures', 0)}, only in A {n.get('only_a', 0)}, "
             f"only in B {n.get('only_b', 0)}"
             + (f" ({moved} matched by tree position: renamed)" if moved else ""),
             f"time counts where B's p10 is above A's p90 (taken at most the threshold above "
             f"A's median), B >= {100 * a['time_threshold_rel']:.0f}% slower "
             f"(the larger of {100 * a['min_time_rel']:.0f}% and the run-to-run noise, "
             f"{100 * noise:.0f}% over {a['noise_calls']} calls) and >= "
             f"{fmt.ms(a['min_time_ms'])} slower",
             f"memory counts from +{100 * a['min_mem_rel']:.0f}% and "
             f"+{fmt.nbytes(a['min_mem_bytes'])}"]
    dropped = df[df["time_contradicted_by"].notna()]
    if len(dropped):
        lines.append(f"{len(dropped)} time change(s) not counted: the enclosing call did not "
                     f"move with them (time_contradicted_by): "
                     + ", ".join(f or "(root)" for f in dropped["fqn"].head(3))
                     + (" ..." if len(dropped) > 3 else ""))
    noisy = [int(df[f"noisy_{s}"].fillna(False).astype(bool).sum()) for s in "ab"]
    if any(noisy):
        lines.append(f"timed on a busy machine (noisy): {noisy[0]} call(s) in A, {noisy[1]} in B")
    return "\n".join(lines)
