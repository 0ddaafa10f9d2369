import click

from cbtrace.cli.options import (model_options, parse_kv, replay_options, strict_exit,
                                 timer_warning)
from cbtrace.errors import RunDirError
from cbtrace.plugins.reporters.opportunities import verified_table
from cbtrace.plugins.reporters.summary import status_text, summary_table
from cbtrace.rundir.read import read_manifest
from cbtrace.workflows.tb_logdir import logdir_target, place_in_logdir


@click.command("profile")
@model_options
@click.option("--out", required=True, type=click.Path(file_okay=False), help="new run directory")
@replay_options
@click.option("--tb-logdir", type=click.Path(file_okay=False), default=None,
              help="also place the run's table and traces (annotated too) at DIR/<run name>, "
                   "where TensorBoard finds them; the run stays at --out")
@click.option("--verify-opportunity", "verify_top", type=click.IntRange(min=0), default=None,
              metavar="N", help="also replay each call compiled, then compile the root and the "
                                "N modules of largest estimated saving in place in the model "
                                "and time the whole step with and without each")
def command(spec, device, dtype, step, opts, include, exclude, max_depth, synthesize_above_bytes,
            with_stack, seed, out, timer, cold, context, tb_logdir, timeout_s, reuse_timing,
            eager_only, verify_top, strict):
    """Capture, replay and attribute: isolated vs in-situ time per module.

    Adds insitu_ms and error_pct (isolated / in-situ - 1) to RUN/modules.parquet and prints the
    error table by module class. Example: cbtrace profile --model nanogpt:tiny --out runs/gpt
    """
    # imported on use, so that `cbtrace profile --help` imports no torch/pandas/pyarrow
    from cbtrace.annotate.write import annotate
    from cbtrace.attribution.join import error_table
    from cbtrace.replay.engine import replay_notes
    from cbtrace.replay.modes.opportunity import verify_spec
    from cbtrace.workflows.profile_model import profile

    if tb_logdir:
        try:
            logdir_target(out, tb_logdir)  # an existing view is refused before any work
        except RunDirError as e:  # the logdir and the run's name are these flags here
            raise click.ClickException(f"{str(e).partition(';')[0]}; choose another "
                                       "--tb-logdir or --out name") from None
    replay_options = dict(timer=timer, cold=cold, context=context, timeout_s=timeout_s,
                          reuse_timing=reuse_timing, eager_only=eager_only)
    if verify_top is not None:
        replay_options["modes"] = ("compile",)
    df = profile(spec, out, replay_options=replay_options, device=device,
                 dtype=dtype, step=step, seed=seed, options=parse_kv(opts), include=include,
                 exclude=exclude, max_depth=max_depth,
                 synthesize_above_bytes=synthesize_above_bytes, with_stack=with_stack)
    click.echo(summary_table(df))
    click.echo("\nisolation error by module class (error_pct = isolated / in-situ - 1, %):")
    click.echo(error_table(df).to_string(float_format=lambda x: f"{x:.1f}"))
    for note in replay_notes(read_manifest(out), step == "train"):
        click.echo(note)
    if tb_logdir:
        annotate(run=out)
        click.echo(f"TensorBoard: {place_in_logdir(out, tb_logdir)}; "
                   f"tensorboard --logdir {tb_logdir}")
    if verify_top is not None:
        checked = verify_spec(spec, df, verify_top, device=device, dtype=dtype, step=step,
                              seed=seed, options=parse_kv(opts))
        types = dict(zip(df["fqn"].fillna(""), df["module_type"]))
        click.echo("\n" + verified_table(checked, types))
    click.echo(f"run: {out}")
    click.echo(status_text(df))
    warning = timer_warning(df, timer)
    if warning:
        click.echo(warning, err=True)
    strict_exit(df, strict)
