"""Errors at the edge and the public API (issue 32): one helper makes the one-line text of an
exception, the CLI range-checks numeric options in one line with exit 2, and ``cbtrace.capture``
/ ``replay`` / ``annotate`` are plain functions whose signatures tools can read."""
import pytest

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


def _numeric_options_without_range(name):
    import importlib

    import click

    from cbtrace.cli.main import COMMANDS

    command = importlib.import_module(COMMANDS[name][0]).command
    plain = (click.types.IntParamType, click.types.FloatParamType)
    return [p.opts[0] for p in command.params
            if isinstance(p.type, plain) and not isinstance(p.type, (click.IntRange,
                                                                     click.FloatRange))]


@pytest.mark.parametrize("name", ["annotate", "attribute", "calibrate", "capture", "demo", "diff",
                                  "models", "report", "trust"])
def test_every_numeric_option_has_a_range(name):
    assert _numeric_options_without_range(name) == []


@pytest.mark.parametrize("args, flag", [
    (["attribute", "t.json", "--top", "0"], "--top"),
    (["attribute", "t.json", "--steps-per-window", "-1"], "--steps-per-window"),
    (["report", "run", "--top", "-3"], "--top"),
    (["capture", "--model", "nanogpt:tiny", "--out", "x", "--seed", "-1"], "--seed"),
    (["capture", "--model", "nanogpt:tiny", "--out", "x", "--synthesize-above", "-5"],
     "--synthesize-above"),
    (["diff", "a", "b", "--spread-q", "2"], "--spread-q"),
])
def test_a_value_out_of_range_is_one_line_and_exit_2(args, flag, tmp_path, capsys,
                                                     monkeypatch):
    from cbtrace.cli.main import main

    monkeypatch.chdir(tmp_path)
    for name in ("t.json", "run", "a", "b"):  # paths that exist, so the range check is what fails
        (tmp_path / name).mkdir() if name != "t.json" else (tmp_path / name).write_text("{}")
    with pytest.raises(SystemExit) as exc:
        main(args)
    err = capsys.readouterr().err
    assert exc.value.code == 2
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and f"'{flag}'" in lines[0] and "range" in lines[0], err
    assert "Traceback" not in err
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("name, impl", [
    ("capture", "cbtrace.capture.recorder:capture"),
    ("replay", "cbtrace.replay.engine:replay"),
    ("annotate", "cbtrace.annotate.write:annotate"),
])
def test_the_public_functions_show_their_implementations_signatures(name, impl):
    import importlib
    import inspect

    import cbtrace

    module, attr = impl.split(":")
    func = getattr(cbtrace, name)
    assert inspect.isfunction(func)
    shown = inspect.signature(func)
    real = inspect.signature(getattr(importlib.import_module(module), attr))
    assert list(shown.parameters) == list(real.parameters)
    assert [p.default for p in shown.parameters.values()] == [
        p.default for p in real.parameters.values()]
    assert getattr(cbtrace, name) is func  # importing the package did not replace the function


def test_replay_signature_names_its_parameters():
    import inspect

    import cbtrace

    assert list(inspect.signature(cbtrace.replay).parameters) == ["run", "model", "device",
                                                                  "options"]


def test_capture_is_a_context_manager_and_load_inputs_returns_the_call(tmp_path):
    import torch

    import cbtrace

    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU())
    x = torch.randn(2, 4)
    with cbtrace.capture(model, tmp_path / "run", trace=False) as cap:
        model(x)
    assert [r.fqn for r in cap.records] == ["", "0", "1"]
    args, kwargs = cbtrace.load_inputs(tmp_path / "run", "0", 0)
    assert torch.equal(args[0], x) and kwargs == {}


def test_a_library_error_names_the_argument_and_the_cli_names_the_flag(tmp_path, capsys):
    from cbtrace.capture.from_spec import capture_model
    from cbtrace.cli.main import main
    from cbtrace.errors import CaptureError

    with pytest.raises(CaptureError) as exc:
        capture_model("nanogpt:tiny", tmp_path / "r", dtype="int3")
    assert str(exc.value).startswith("dtype int3: expected one of fp32")
    assert exc.value.param == "dtype" and "--" not in str(exc.value)
    for args, line in [(["--dtype", "int3"], "Error: --dtype int3: expected one of fp32"),
                       (["--device", "nope"], "Error: --device nope: not a device")]:
        with pytest.raises(SystemExit) as code:
            main(["capture", "--model", "nanogpt:tiny", *args, "--out", str(tmp_path / "r")])
        err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
        assert code.value.code == 1 and len(err) == 1 and err[0].startswith(line), err
    assert not (tmp_path / "r").exists()


def test_an_error_without_an_argument_reads_the_same_everywhere():
    from cbtrace.errors import CbtraceError

    e = CbtraceError("runs/x: no manifest.json")
    assert str(e) == e.for_flag("--out") == "runs/x: no manifest.json"


def test_replay_numeric_options_are_ranged(tmp_path):
    """`cbtrace replay RUN --budget-s -1` printed a traceback: now one line, exit 2."""
    from click.testing import CliRunner

    from cbtrace.cli.main import cli

    run = tmp_path / "run"
    run.mkdir()
    for args in (["--budget-s", "-1"], ["--memory-budget", "-5"], ["--top", "0"]):
        r = CliRunner().invoke(cli, ["replay", str(run), *args])
        assert r.exit_code == 2, (args, r.output)
        assert "Traceback" not in r.output and "is not in the range" in r.output
