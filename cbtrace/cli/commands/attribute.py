import contextlib
from pathlib import Path

import click

from cbtrace.cli.options import parse_kv
from cbtrace.rundir.files import atomic_path

OUT_SUFFIXES = (".parquet", ".csv")


@click.command("attribute")
@click.argument("traces", nargs=-1, required=True, type=click.Path(exists=True))
@click.option("--out", type=click.Path(dir_okay=False), default=None,
              help="write the full table here (.parquet or .csv)")
@click.option("--capture-run", type=click.Path(exists=True, file_okay=False), default=None,
              help="cbtrace run of the same model: names nn.Module events by their real paths")
@click.option("--model", "spec", default=None, metavar="SPEC",
              help="the traced model's spec (nanogpt:tiny, pkg.module:fn): names nn.Module "
                   "events by their real paths, built on the meta device (no weights, no capture)")
@click.option("--option", "-o", "opts", multiple=True, metavar="KEY=VALUE",
              help="provider option for --model, e.g. -o batch_size=8 (repeatable)")
@click.option("--top", type=click.IntRange(min=1), default=15, show_default=True,
              help="rows in the summary")
@click.option("--force", is_flag=True, help="overwrite an existing --out file")
@click.option("--steps-per-window", type=click.IntRange(min=1), default=None, metavar="N",
              help="read N profiler steps at a time (bounded memory, for traces larger than RAM)")
@click.option("--workers", type=click.IntRange(min=1), default=None, metavar="N",
              help="processes reading traces in parallel, one file at a time each "
                   "[default: one per core]")
def command(traces, out, capture_run, spec, opts, top, force, steps_per_window, workers):
    """Attribute time in Kineto traces to modules.

    TRACES are trace files, directories of per-rank traces, or cbtrace run directories (their
    capture trace); an annotated_* trace given beside its original is skipped.

    Prints the modules with the most in-situ time (medians over steps), then, for 2+ ranks,
    each call's min / median / max over ranks, its slowest rank and the spread.
    Example: cbtrace attribute logs/ --model nanogpt --out table.parquet
    """
    # imported on use, so that `cbtrace attribute --help` imports no torch/pandas/pyarrow
    from cbtrace.attribution.attribute import attribute, summary_text
    from cbtrace.attribution.ranks import across_text

    if capture_run and spec:
        raise click.UsageError("give --capture-run or --model, not both")
    if opts and not spec:
        raise click.UsageError("--option needs --model")
    if out and not out.endswith(OUT_SUFFIXES):
        raise click.BadParameter(f"{out}: write .parquet or .csv", param_hint="--out")
    if out and Path(out).exists() and not force:
        raise click.ClickException(f"{out}: already exists (use --force to overwrite)")
    with contextlib.ExitStack() as stack:  # the temp file first: an unwritable --out fails at once
        tmp = stack.enter_context(atomic_path(Path(out))) if out else None
        df = attribute(list(traces), capture_run=capture_run, model=spec,
                       model_options=parse_kv(opts), steps_per_window=steps_per_window,
                       workers=workers)
        if out and out.endswith(".csv"):
            df.to_csv(tmp, index=False)
        elif out:
            df.to_parquet(tmp, index=False)
    click.echo(summary_text(df, top=top))
    if df["rank"].nunique() >= 2:
        click.echo(across_text(df, top=top))
    if out:
        click.echo(f"wrote {len(df)} rows to {out}")
