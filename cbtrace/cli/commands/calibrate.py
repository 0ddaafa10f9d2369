"""cbtrace calibrate: measure this device's achievable matmul FLOP/s and copy bandwidth."""
from pathlib import Path

import click

from cbtrace.errors import CbtraceError


@click.command(help="Measure this device's achievable matmul FLOP/s per dtype and copy bandwidth, "
                    "and store them (peaks used for mfu_calibrated / mbu_calibrated).")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default=None,
              help="Device to measure (default: cuda if available, else cpu).")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Calibration file (default: $CBTRACE_CALIBRATION or ~/.cache/cbtrace/calibration.json).")
def command(device, out):
    # imported on use, so that `cbtrace calibrate --help` imports no torch/pandas/pyarrow
    from cbtrace.cost.calibrate import calibrate, format_calibration

    try:
        entry = calibrate(device, out=out)
    except CbtraceError as e:  # the device is its one argument a message names
        raise click.ClickException(e.for_flag("--device")) from e
    click.echo(format_calibration(entry))
