"""Errors at the edge and the public API (issue 32): one helper makes the one-line text of an
exception, the CLI range-checks numeric options in one line with exit 2, and ``cbtrace.capture``
/ ``replay`` / ``annotate`` are plain functions whose signatures tools can read."""
from cbtrace.errors import one_line


def test_one_line_takes_the_first_non_blank_line_with_the_type():
    assert one_line(ValueError("\n  bad shape\ntraceback follows")) == "ValueError: bad shape"
    assert one_line(KeyError()) == "KeyError"
    assert one_line(OSError("disk full"), with_type=False) == "disk full"
    assert one_line(RuntimeError(""), with_type=False) == "RuntimeError"


def test_one_line_cuts_to_the_limit_and_reads_text():
    assert one_line("x" * 1000) == "x" * 300
    assert one_line(ValueError("y" * 50), limit=20) == "ValueError: " + "y" * 8
    assert one_line("   \n") == ""
