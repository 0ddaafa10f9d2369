"""``python -m cbtrace.replay RUN [flags]``: what torchrun runs on each rank (and the same as
``cbtrace replay RUN [flags]`` in one process)."""
import sys

from cbtrace.cli.main import main

main(["replay", *sys.argv[1:]])
