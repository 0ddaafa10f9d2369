import os

import click

import cbtrace
from cbtrace.cli.options import (parse_modes, parse_workers, replay_options, strict_exit,
                                 timer_warning)
from cbtrace.plugins.reporters.opportunities import modes_note
from cbtrace.plugins.reporters.summary import status_text, summary_table
from cbtrace.replay.config import ReplayConfig
from cbtrace.rundir.lock import RunLock
from cbtrace.rundir.read import read_manifest


@click.command("replay")
@click.argument("run", type=click.Path(exists=True, file_okay=False))
@click.option("--device", default=None, help="cpu, cuda or cuda:N (default: the capture device)")
@replay_options
@click.option("--budget-s", type=click.FloatRange(min=0), default=None,
              help=f"timing budget per call (seconds; default {ReplayConfig.budget_s}, with "
                   f"--cold {ReplayConfig.cold_budget_s})")
@click.option("--memory-budget", "memory_budget_bytes", type=click.IntRange(min=0), default=None,
              metavar="BYTES",
              help="skip calls whose estimated footprint exceeds this")
@click.option("--resume", is_flag=True, help="continue an interrupted replay")
@click.option("--model", "model_spec", default=None, metavar="SPEC",
              help="rebuild the model from this spec (as cbtrace capture --model takes it, with "
                   "the run's options and seed) instead of the run's")
@click.option("--trust", is_flag=True,
              help="rebuild the model from the run's own spec even if it names code "
                   "(file.py:fn, pkg.module:fn) and the run is not signed by you, which then "
                   "runs: only for runs you trust (runs you capture are signed; a run from "
                   "elsewhere: cbtrace trust RUN)")
@click.option("--modes", default="eager", show_default=True, metavar="LIST",
              help="also time each call compiled and/or from a CUDA graph: eager,compile,cudagraph")
@click.option("--compile-mode", default=ReplayConfig.compile_mode, show_default=True,
              help="torch.compile mode for --modes compile (e.g. max-autotune-no-cudagraphs)")
@click.option("--compile-workers", default="0", show_default=True, metavar="N|auto",
              callback=lambda ctx, param, v: parse_workers(v),
              help="compile what --modes compile will compile ahead, in N processes that rebuild "
                   "the model from the run's spec, so the replay's compiles hit inductor's cache "
                   "(auto: on a GPU, up to 8 as CPUs and memory allow)")
@click.option("--modes-budget-s", type=click.FloatRange(min=0), default=None, metavar="S",
              help="seconds the other modes may take in all; later calls are skipped in them "
                   "(their status says so) and timed eagerly as usual")
@click.option("--backward", is_flag=True,
              help="also replay each call's backward on its captured (else random) output grads")
@click.option("--count-every-call", is_flag=True,
              help="count FLOPs and run the profiled pass for every call, not once per kind of "
                   "work (a call of the same module, shapes and arguments takes the first's)")
@click.option("--nproc", type=click.IntRange(min=1), default=None, metavar="N",
              help="shard the calls over N processes (one GPU each) by starting torchrun's "
                   "elastic agent; the same as torchrun --nproc-per-node N -m cbtrace.replay RUN")
@click.option("--top", type=click.IntRange(min=1), default=15, show_default=True,
              help="rows in the summary")
def command(run, device, timer, budget_s, memory_budget_bytes, cold, context, resume, model_spec,
            trust, timeout_s, modes, compile_mode, compile_workers, modes_budget_s, backward,
            reuse_timing, eager_only, count_every_call, nproc, strict, top):
    """Replay every captured module of RUN standalone, breadth-first, and measure it.

    Writes the results into RUN/modules.parquet and prints the slowest modules. The model is
    rebuilt from the run's spec only if that names a registered provider (cbtrace models) or
    the run is signed by you (captured here, or cbtrace trust RUN); otherwise name it with
    --model SPEC, or pass --trust to run the code the run names.
    Example: cbtrace replay runs/gpt --timer auto
    """
    if nproc is not None and "LOCAL_RANK" not in os.environ:  # not yet under torchrun
        return launch_torchrun(click.get_current_context(), nproc)
    # imported on use, so that `cbtrace replay --help` imports no torch/pandas/pyarrow
    from cbtrace.replay.engine import replay_notes

    opts = dict(timer=timer, resume=resume, memory_budget_bytes=memory_budget_bytes, cold=cold,
                context=context,
                model_spec=model_spec, trust=trust, timeout_s=timeout_s,
                modes=parse_modes(modes), compile_mode=compile_mode,
                compile_workers=compile_workers,
                modes_budget_s=modes_budget_s, backward=backward,
                reuse_timing=reuse_timing, reuse_counts=not count_every_call,
                eager_only=eager_only)
    if budget_s is not None:
        opts["cold_budget_s" if cold else "budget_s"] = budget_s
    df = cbtrace.replay(run, device=device, **opts)
    if int(os.environ.get("RANK", "0")) != 0:
        return  # a rank of a sharded replay: rank 0 reports for all
    click.echo(summary_table(df, top=top))
    manifest = read_manifest(run)
    for note in replay_notes(manifest, backward):
        click.echo(note)
    click.echo(status_text(df))
    if manifest.replay.compile_ahead:
        click.echo(manifest.replay.compile_ahead)
    skipped = modes_note(df)
    if skipped:
        click.echo(f"modes:\n{skipped}")
    warning = timer_warning(df, timer)
    if warning:
        click.echo(warning, err=True)
    strict_exit(df, strict)


def launch_torchrun(ctx, nproc: int) -> None:
    """``torchrun --standalone --nproc-per-node N -m cbtrace.replay RUN <the other flags>``,
    through torchrun's own elastic agent; its exit status is this command's."""
    # imported on use, so that `cbtrace replay --help` imports no torch/pandas/pyarrow
    from torch.distributed.run import get_args_parser, run

    args = [ctx.params["run"]]
    for p in ctx.command.params:
        value = ctx.params[p.name]
        if not isinstance(p, click.Option) or p.name == "nproc":
            continue
        if p.is_flag:
            if value:
                args.append(p.opts[0])
        elif value is not None and value != p.default:
            args += [p.opts[0], ",".join(value) if isinstance(value, tuple) else str(value)]
    launcher = ["--standalone", "--nproc-per-node", str(nproc), "-m", "cbtrace.replay", *args]
    with RunLock(ctx.params["run"], "replay"):  # held for the ranks, which it starts
        try:
            run(get_args_parser().parse_args(launcher))
        except Exception as e:  # torchrun's ChildFailedError: a rank failed; it printed why
            raise click.ClickException(f"sharded replay failed ({type(e).__name__}); rows the "
                                       "ranks finished are kept: rerun with --resume") from None
