"""Plugin layers: a third-party package installed with pip is found through entry points."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

from cbtrace import hookspecs, registry

PLUGIN = '''
from cbtrace.hookspecs import hookimpl


class Provider:
    def __init__(self, spec="", seed=0, options=None):
        self.spec = spec

    def model_and_batch(self, device="cpu", dtype=None):
        import torch
        return torch.nn.Linear(2, 2), (torch.ones(1, 2),)

    @staticmethod
    def run(model, batch):
        return model(*batch)


class Fraction:
    name = "fraction"

    def handles(self, obj):
        import fractions
        return isinstance(obj, fractions.Fraction)

    def encode(self, obj, ctx):
        return {"num": obj.numerator, "den": obj.denominator}

    def decode(self, node, ctx):
        import fractions
        return fractions.Fraction(node["num"], node["den"])


class ConstantTimer:
    """Times every call at 1.234 ms, after running it once (proves it was the one used)."""
    name = "constant"

    def unavailable_reason(self, device):
        return None

    def measure(self, call, n_copies, device, cfg):
        from cbtrace.replay.timer.contract import Timing

        call(0)
        return Timing(median_ms=1.234, p10_ms=1.234, p90_ms=1.234, runs=1, timer=self.name,
                      notes="third-party")


class ContractTimer:
    """Written against the timer contract in cbtrace.replay.timer.contract only: each copy's untimed
    before, then its run between two perf_counter reads."""
    name = "bycontract"

    def unavailable_reason(self, device):
        return None if str(device) == "cpu" else "bycontract: cpu only"

    def measure(self, call, n_copies, device, cfg):
        import time
        from cbtrace.replay.timer.contract import CallRunner, Timing

        assert isinstance(call, CallRunner) and call.n_copies == n_copies
        samples = []
        for i in range(max(cfg.min_runs, call.n_copies)):
            j = i % call.n_copies
            if call.before is not None:
                call.before(j)
            t0 = time.perf_counter()
            call.run(j)
            samples.append((time.perf_counter() - t0) * 1e3)
        samples.sort()
        return Timing(median_ms=samples[len(samples) // 2], p10_ms=samples[0],
                      p90_ms=samples[-1], runs=len(samples), timer=self.name,
                      notes=f"copies={call.n_copies}")


class NullTimer:
    def unavailable_reason(self, device):
        return "a test timer"


class Echo:
    def report(self, records, manifest, out_dir):
        return None

    def close(self):
        return None


@hookimpl
def register_models(register):
    register("thirdparty", Provider)


@hookimpl
def register_serializers(register):
    register(Fraction())


@hookimpl
def register_backends(register):
    register("nulltimer", NullTimer())
    register("constant", ConstantTimer())
    register("bycontract", ContractTimer())


@hookimpl
def register_reporters(register):
    register("echo", Echo())
'''

PYPROJECT = '''
[build-system]
requires = ["setuptools"]
build-backend = "setuptools.build_meta"

[project]
name = "cbtrace-thirdparty-example"
version = "0.0.1"

[project.entry-points.cbtrace]
thirdparty = "cbtrace_thirdparty"
'''


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    src = tmp_path_factory.mktemp("pkg")
    (src / "pyproject.toml").write_text(PYPROJECT)
    (src / "cbtrace_thirdparty.py").write_text(PLUGIN)
    target = tmp_path_factory.mktemp("site")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                    "--no-build-isolation", "--target", str(target), str(src)], check=True)
    return target


def plugin_env(site) -> dict:
    """This environment with the plugin installed and entry points loaded (conftest turns them
    off for the suite's own process)."""
    env = dict(os.environ, PYTHONPATH=str(site))
    env.pop("CBTRACE_DISABLE_PLUGIN_AUTOLOAD", None)
    return env


def run_py(code, site):
    env = plugin_env(site)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True)
    return out.stdout


def test_third_party_plugin_found_in_every_layer(site):
    code = textwrap.dedent('''
        import json
        from cbtrace import registry
        print(json.dumps({
            "models": sorted(registry.models()),
            "backends": sorted(registry.backends()),
            "reporters": sorted(registry.reporters()),
            "serializers": [getattr(s, "name", "") for s in registry.serializers()],
        }))
    ''')
    got = json.loads(run_py(code, site).strip().splitlines()[-1])
    assert "thirdparty" in got["models"] and "nanogpt" in got["models"]
    assert "nulltimer" in got["backends"]
    assert "echo" in got["reporters"]
    assert got["serializers"][0] == "fraction"  # third-party first, built-ins after


def test_cli_lists_third_party_plugins(site):
    env = plugin_env(site)
    out = subprocess.run([sys.executable, "-m", "cbtrace", "models"], env=env,
                         capture_output=True, text=True, check=True).stdout
    assert "thirdparty" in out and "nulltimer" in out and "echo" in out


def test_entry_points_not_loaded_when_autoload_is_off():
    assert os.environ["CBTRACE_DISABLE_PLUGIN_AUTOLOAD"]  # conftest
    registry.load()
    names = {name for name, _ in registry.pm.list_name_plugin()}
    assert set(registry.DEFAULT_PLUGINS) & names
    assert not any("thirdparty" in n for n in names)


def test_importing_pytest_does_not_turn_plugins_off(site):
    code = textwrap.dedent('''
        import pytest  # a user's process that merely imports pytest keeps its plugins
        from cbtrace import registry
        print(sorted(registry.models()))
    ''')
    assert "thirdparty" in run_py(code, site)


@pytest.fixture(scope="module")
def captured(site, tmp_path_factory):
    """A small CPU capture with the plugin installed."""
    run = tmp_path_factory.mktemp("captured") / "run"
    subprocess.run([sys.executable, "-m", "cbtrace", "capture", "--model", "dlrm:tiny",
                    "--device", "cpu", "--max-depth", "1", "--out", str(run)],
                   env=plugin_env(site), check=True, capture_output=True)
    return run


def test_a_third_party_timer_is_chosen_with_timer_and_used(site, captured):
    env, run = plugin_env(site), captured
    listed = subprocess.run([sys.executable, "-m", "cbtrace", "models"], env=env,
                            check=True, capture_output=True, text=True).stdout
    assert "constant" in next(x for x in listed.splitlines() if x.startswith("backends:"))
    subprocess.run([sys.executable, "-m", "cbtrace", "replay", str(run), "--timer", "constant"],
                   env=env, check=True, capture_output=True)
    import pandas as pd

    df = pd.read_parquet(run / "modules.parquet")
    assert (df["timer"] == "constant").all() and (df["isolated_ms"] == 1.234).all()
    assert (df["timer_notes"] == "third-party").all() and df["kernel_count"].notna().all()
    bad = subprocess.run([sys.executable, "-m", "cbtrace", "replay", str(run), "--timer", "nope"],
                         env=env, capture_output=True, text=True)
    assert bad.returncode == 2 and "constant" in bad.stderr and "'nope' is not one of" in bad.stderr


def test_a_timer_written_against_the_documented_contract_is_selectable_and_used(site, captured):
    import pandas as pd

    subprocess.run([sys.executable, "-m", "cbtrace", "replay", str(captured), "--timer",
                    "bycontract"], env=plugin_env(site), check=True, capture_output=True)
    df = pd.read_parquet(captured / "modules.parquet")
    assert len(df) > 1 and (df["status"] == "ok").all()
    assert (df["timer"] == "bycontract").all() and df["timer_fallback"].isna().all()
    assert df["timer_notes"].str.contains("copies=", regex=False).all()
    assert (df["runs"] >= 10).all() and (df["isolated_ms"] > 0).all()  # min_runs, one a copy


def test_every_hook_is_documented_and_in_the_readme():
    from helpers.paths import REPO

    specs = [name for name, f in vars(hookspecs).items()
             if callable(f) and hasattr(f, "cbtrace_spec")]
    assert sorted(specs) == ["register_backends", "register_models", "register_reporters",
                             "register_serializers"]
    readme = (REPO / "README.md").read_text()
    for name in specs:
        assert getattr(hookspecs, name).__doc__, name
        assert f"`{name}(register)`" in readme, name


def test_duplicate_registration_raises():
    from cbtrace.errors import PluginError
    from cbtrace.hookspecs import hookimpl

    class Dup:
        @hookimpl
        def register_models(self, register):
            register("nanogpt", object)

    registry.load()
    registry.pm.register(Dup(), name="dup")
    try:
        with pytest.raises(PluginError, match="nanogpt"):
            registry.models()
    finally:
        registry.pm.unregister(name="dup")
