import click


@click.command("annotate")
@click.argument("run_dir", required=False, type=click.Path(exists=True, file_okay=False))
@click.option("--trace", type=click.Path(exists=True, dir_okay=False),
              help="a Kineto trace to annotate (default: the run's own capture trace)")
@click.option("--run", "run_opt", type=click.Path(exists=True, file_okay=False),
              help="a run of the same model whose figures go on the trace")
@click.option("--out", type=click.Path(dir_okay=False),
              help="output path (default: annotated_<name> beside the trace)")
@click.option("--force", is_flag=True, help="overwrite an existing output")
@click.option("--no-pftrace", is_flag=True, help="skip the Perfetto protobuf (.pftrace) output")
def command(run_dir, trace, run_opt, out, force, no_pftrace):
    """Write annotated_<trace> with per-module figures, for Perfetto, TensorBoard and HTA.

    Examples: cbtrace annotate runs/gpt;  cbtrace annotate --trace t.pt.trace.json.gz --run runs/gpt
    """
    # imported on use, so that `cbtrace annotate --help` imports no torch/pandas/pyarrow
    from cbtrace.annotate.pftrace import unavailable_reason
    from cbtrace.annotate.write import annotate, pftrace_path

    if run_dir and run_opt and run_dir != run_opt:
        raise click.UsageError("give the run either as RUN_DIR or as --run, not both")
    run = run_dir or run_opt
    if run is None and trace is None:
        raise click.UsageError("give a run directory, --trace FILE, or both")
    skipped = None if no_pftrace else unavailable_reason()
    path = annotate(run=run, trace=trace, out=out, force=force,
                    pftrace=not no_pftrace and skipped is None)
    click.echo(f"annotated trace: {path}")
    if skipped:
        click.echo(f"perfetto trace:  skipped ({skipped})")
    elif not no_pftrace:
        click.echo(f"perfetto trace:  {pftrace_path(path)}")
