import click


@click.command("attribute")
@click.argument("traces", nargs=-1, required=True, type=click.Path(exists=True))
@click.option("--out", type=click.Path(dir_okay=False), default=None,
              help="write the full table here (.parquet or .csv)")
@click.option("--capture-run", type=click.Path(exists=True, file_okay=False), default=None,
              help="cbtrace run of the same model: names nn.Module events by their real paths")
@click.option("--top", type=int, default=15, show_default=True, help="rows in the summary")
@click.option("--force", is_flag=True, help="overwrite an existing --out file")
@click.option("--steps-per-window", type=int, default=None, metavar="N",
              help="read N profiler steps at a time (bounded memory, for traces larger than RAM)")
def command(traces, out, capture_run, top, force, steps_per_window):
    """Attribute time in Kineto traces (files or per-rank directories) to modules.

    Prints the modules with the most in-situ time (medians over steps).
    Example: cbtrace attribute logs/rank0.pt.trace.json.gz --out table.parquet
    """
    import contextlib
    from pathlib import Path

    from cbtrace.attribution.attribute import attribute, summary_text
    from cbtrace.rundir.files import atomic_path

    if out and Path(out).exists() and not force:
        raise click.ClickException(f"{out}: already exists (use --force to overwrite)")
    with contextlib.ExitStack() as stack:  # the temp file first: an unwritable --out fails at once
        tmp = stack.enter_context(atomic_path(Path(out))) if out else None
        df = attribute(list(traces), capture_run=capture_run, steps_per_window=steps_per_window)
        if out and out.endswith(".csv"):
            df.to_csv(tmp, index=False)
        elif out:
            df.to_parquet(tmp, index=False)
    click.echo(summary_text(df, top=top))
    if out:
        click.echo(f"wrote {len(df)} rows to {out}")
