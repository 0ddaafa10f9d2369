"""Thin CLI: each command parses flags, calls one library function, prints the result.

Commands live in ``cbtrace/commands/<name>.py`` and are imported only when invoked,
so ``cbtrace --help`` imports neither torch nor pyarrow.
"""
import importlib
import importlib.util
import sys
import warnings

import click

from cbtrace.errors import CbtraceError

# name -> (module, short help). Each module defines a click command named ``command``.
COMMANDS = {
    "demo": ("cbtrace.cli.commands.demo", "Capture and replay the embedded CPU demo model."),
    "capture": ("cbtrace.cli.commands.capture", "Capture one step of a model into a run directory."),
    "replay": ("cbtrace.cli.commands.replay", "Replay every captured module standalone and measure it."),
    "profile": ("cbtrace.cli.commands.profile", "Capture, replay and attribute: the isolation error table."),
    "attribute": ("cbtrace.cli.commands.attribute", "Attribute time in Kineto traces to modules."),
    "annotate": ("cbtrace.cli.commands.annotate", "Write annotated_<trace> with per-module figures."),
    "diff": ("cbtrace.cli.commands.diff", "Compare two runs module by module; flag regressions."),
    "report": ("cbtrace.cli.commands.report", "Write the interactive icicle (icicle.html) of a run."),
    "calibrate": ("cbtrace.cli.commands.calibrate", "Measure this device's achievable FLOP/s and bandwidth."),
    "models": ("cbtrace.cli.commands.models", "List model providers and other registered plugins."),
    "trust": ("cbtrace.cli.commands.trust", "Sign a run from elsewhere so that replay rebuilds its model."),
}


class Interrupted(Exception):
    """Ctrl-C inside a command, kept from click so that it does not become a plain Abort."""


class LazyGroup(click.Group):
    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt as e:
            raise Interrupted() from e

    def list_commands(self, ctx):
        return sorted(c for c, (m, _) in COMMANDS.items() if importlib.util.find_spec(m))

    def get_command(self, ctx, name):
        if name not in COMMANDS:
            return None
        module = importlib.import_module(COMMANDS[name][0])
        return module.command

    def format_commands(self, ctx, formatter):
        rows = [(name, COMMANDS[name][1]) for name in self.list_commands(ctx)]
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


# -h on every command too: subcommands' contexts inherit help_option_names from the group's
@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="cbtrace")
def cli():
    """cbtrace: which nn.Module is slow, and why."""


def _one_line_warning(message, category, filename, lineno, line=None):
    """A warning as one line for the terminal (no source location or code line)."""
    return f"Warning: {message}\n"


def _interrupted():
    if sys.stderr.isatty():  # closes the terminal's ^C echo
        click.echo("", err=True)
    click.echo("Interrupted.", err=True)
    sys.exit(130)


def main(argv=None):
    old_format = warnings.formatwarning
    warnings.formatwarning = _one_line_warning
    try:
        _run(argv)
    finally:  # callers in the same process (tests) get their formatter back
        warnings.formatwarning = old_format


def _in_flags(e: CbtraceError, argv) -> str:
    """The error's message naming the flags, where the library named its own arguments: the
    command's own flag, else (for ``retry``) the flag of the command that has it."""
    args = sys.argv[1:] if argv is None else list(argv)
    name = next((a for a in args if a in COMMANDS), None)
    if (e.param is None and not e.retries) or name is None:
        return str(e)
    flags = _flags(name)
    others = set(e.retries) - set(flags)  # e.g. capture into a failed replay's run
    if others:
        flags.update({k: f for c in COMMANDS for k, f in _flags(c).items() if k in others})
    return e.for_cli(flags)


def _flags(command: str) -> dict[str, str]:
    """A command's options: library argument -> its longest flag."""
    params = importlib.import_module(COMMANDS[command][0]).command.params
    return {p.name: max(p.opts, key=len) for p in params if isinstance(p, click.Option)}


def _run(argv):
    try:
        cli.main(args=argv, prog_name="cbtrace", standalone_mode=False)
    except Interrupted:
        _interrupted()
    except click.exceptions.Abort as e:
        if isinstance(e.__cause__, KeyboardInterrupt):  # Ctrl-C while click parsed the flags
            _interrupted()
        click.echo("Aborted.", err=True)
        sys.exit(1)
    except click.UsageError as e:  # one line, like every other error: no usage block
        where = f" (see {e.ctx.command_path} --help)" if e.ctx is not None else ""
        click.echo(f"Error: {e.format_message()}{where}", err=True)
        sys.exit(e.exit_code)
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
    except CbtraceError as e:
        click.echo(f"Error: {_in_flags(e, argv)}", err=True)
        sys.exit(1)
    except KeyboardInterrupt:
        _interrupted()

if __name__ == "__main__":
    main()
