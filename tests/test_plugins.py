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


class NullTimer:
    def unavailable_reason(self, device):
        return "a test timer"


class Echo:
    def report(self, records, out_dir):
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


def run_py(code, site):
    env = dict(os.environ, PYTHONPATH=str(site))
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
    env = dict(os.environ, PYTHONPATH=str(site))
    out = subprocess.run([sys.executable, "-m", "cbtrace", "models"], env=env,
                         capture_output=True, text=True, check=True).stdout
    assert "thirdparty" in out and "nulltimer" in out and "echo" in out


def test_entry_points_not_loaded_under_pytest():
    registry.load()
    names = {name for name, _ in registry.pm.list_name_plugin()}
    assert set(registry.DEFAULT_PLUGINS) & names
    assert not any("thirdparty" in n for n in names)


def test_every_hook_is_documented():
    for name in ("register_models", "register_serializers", "register_backends",
                 "register_reporters"):
        assert getattr(hookspecs, name).__doc__


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
