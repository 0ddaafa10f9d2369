from pathlib import Path

import click

from cbtrace.cli.options import model_options, parse_kv


@click.command("capture")
@model_options
@click.option("--out", required=True, type=click.Path(file_okay=False), help="new run directory")
def command(spec, device, dtype, step, opts, include, exclude, max_depth, synthesize_above_bytes,
            with_stack, seed, out):
    """Capture one step of a model into a run directory (inputs, module tree, Kineto trace).

    Example: cbtrace capture --model nanogpt:tiny --out runs/gpt
    """
    # imported on use, so that `cbtrace capture --help` imports no torch/pandas/pyarrow
    from cbtrace.capture.from_spec import capture_model

    cap = capture_model(spec, Path(out), device=device, dtype=dtype, step=step, seed=seed,
                        options=parse_kv(opts), include=include, exclude=exclude,
                        max_depth=max_depth, synthesize_above_bytes=synthesize_above_bytes,
                        with_stack=with_stack)
    click.echo(f"captured {len(cap.records)} module calls in {cap.step_s:.3f} s -> {cap.out}")
    if cap.trace_path:
        click.echo(f"trace: {cap.trace_path}")
