"""Running the cbtrace CLI inside the test process."""
from cbtrace.cli.main import main


def run_cli(args, capsys) -> tuple[int, str, str]:
    """``cbtrace ARGS`` in this process: (exit code, stdout, stderr)."""
    try:
        main([str(a) for a in args])
        code = 0
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err
