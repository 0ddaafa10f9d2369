"""Nothing global touched (issue 29): capture, replay (its first-run calibration included) and
calibration leave every process-wide setting as they found it, through one guard
(``cbtrace.global_state.GlobalSettings``), tested for each setting it keeps."""
import random

import numpy as np
import pytest
import torch
from helpers.settings import FAST_REPLAY
from torch import nn

import cbtrace
from cbtrace.global_state import GLOBALS, GlobalSettings, read_globals, same_value


def _flip(flag: str):
    obj, _, name = flag.rpartition(".")

    def change():
        o = torch
        for part in obj.split(".")[1:]:
            o = getattr(o, part)
        setattr(o, name, not getattr(o, name))
    return change


def _precision(path: str):
    def change():
        o = torch
        for part in path.split(".")[1:]:
            o = getattr(o, part)
        o.fp32_precision = "ieee" if o.fp32_precision != "ieee" else "tf32"
    return change


# each setting GLOBALS keeps -> a change of it (what a careless replay or calibration might do)
CHANGES = {
    "torch_rng": lambda: torch.rand(3),
    "python_rng": lambda: random.random(),
    "numpy_rng": lambda: np.random.rand(),
    "default_dtype": lambda: torch.set_default_dtype(torch.float64),
    "grad_enabled": lambda: torch.set_grad_enabled(not torch.is_grad_enabled()),
    "autocast_cpu": lambda: (torch.set_autocast_enabled("cpu", True),
                             torch.set_autocast_dtype("cpu", torch.float16)),
    "autocast_cuda": lambda: torch.set_autocast_enabled("cuda", True),
    "autocast_cache": lambda: torch.set_autocast_cache_enabled(False),
    "deterministic_algorithms": lambda: torch.use_deterministic_algorithms(True, warn_only=True),
    "cudnn_enabled": _flip("torch.backends.cudnn.enabled"),
    "cudnn_benchmark": _flip("torch.backends.cudnn.benchmark"),
    "cudnn_deterministic": _flip("torch.backends.cudnn.deterministic"),
    "cudnn_allow_tf32": _flip("torch.backends.cudnn.allow_tf32"),
    "matmul_allow_tf32": _flip("torch.backends.cuda.matmul.allow_tf32"),
    "float32_matmul_precision": lambda: torch.set_float32_matmul_precision("medium"),
    "fp32_precision": _precision("torch.backends"),
    "cuda_matmul_fp32_precision": _precision("torch.backends.cuda.matmul"),
    "cudnn_fp32_precision": _precision("torch.backends.cudnn"),
    "cudnn_conv_fp32_precision": _precision("torch.backends.cudnn.conv"),
    "cudnn_rnn_fp32_precision": _precision("torch.backends.cudnn.rnn"),
    "mkldnn_fp32_precision": _precision("torch.backends.mkldnn"),
    "mkldnn_matmul_fp32_precision": _precision("torch.backends.mkldnn.matmul"),
    "mkldnn_conv_fp32_precision": _precision("torch.backends.mkldnn.conv"),
    "mkldnn_rnn_fp32_precision": _precision("torch.backends.mkldnn.rnn"),
    "matmul_fp16_reduced_precision": _flip(
        "torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction"),
    "matmul_bf16_reduced_precision": _flip(
        "torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction"),
    "sdp_flash": lambda: torch.backends.cuda.enable_flash_sdp(False),
    "sdp_mem_efficient": lambda: torch.backends.cuda.enable_mem_efficient_sdp(False),
    "sdp_math": lambda: torch.backends.cuda.enable_math_sdp(False),
    "sdp_cudnn": lambda: torch.backends.cuda.enable_cudnn_sdp(False),
    "num_threads": lambda: torch.set_num_threads(torch.get_num_threads() % 2 + 1),
}
# not changed here: CUDA's RNG needs a GPU (test_cuda_rng_is_restored); the inter-op thread
# count can be set once per process, before any inter-op work, so nothing can change it now
UNCHANGEABLE = {"cuda_rng", "num_interop_threads"}


@pytest.fixture
def baseline():
    """Every setting as before the test, whatever the test did (a failed guard included)."""
    saved = read_globals()
    yield saved
    from cbtrace.global_state import restore_globals

    restore_globals(saved)


def test_every_kept_setting_has_a_change_here():
    assert set(CHANGES) | UNCHANGEABLE == set(GLOBALS)


@pytest.mark.parametrize("name", sorted(CHANGES))
def test_the_guard_restores(name, baseline):
    with GlobalSettings():
        CHANGES[name]()
        inside = read_globals()[name]
    assert not same_value(inside, baseline[name]), f"{name}: the change did not take"
    after = read_globals()
    assert [k for k in GLOBALS if not same_value(after[k], baseline[k])] == []


def test_the_guard_restores_on_error_and_as_a_decorator(baseline):
    @GlobalSettings()
    def careless():
        torch.manual_seed(123)
        torch.set_default_dtype(torch.float64)
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        careless()
    after = read_globals()
    assert [k for k in GLOBALS if not same_value(after[k], baseline[k])] == []


@pytest.mark.gpu
def test_cuda_rng_is_restored(baseline):
    torch.cuda.init()
    before = torch.cuda.get_rng_state_all()
    with GlobalSettings():
        torch.rand(3, device="cuda")
    assert all(torch.equal(a, b) for a, b in zip(before, torch.cuda.get_rng_state_all()))


# -- the entry points -----------------------------------------------------------------------

def _caller_settings():
    """Settings a caller might hold that differ from torch's defaults, RNGs seeded."""
    torch.manual_seed(7)
    random.seed(7)
    np.random.seed(7)
    torch.set_num_threads(1)
    torch.set_float32_matmul_precision("high")
    torch.backends.cudnn.benchmark = True
    torch.use_deterministic_algorithms(True, warn_only=True)


def _tiny():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.ReLU(), nn.Linear(8, 2))


@pytest.fixture(scope="module")
def entry_points(tmp_path_factory):
    """name -> (settings before, settings after) of each entry point, run once each in a
    caller's non-default settings: capture, capture from a spec, a first replay on a machine
    with no stored calibration (it calibrates), and calibration."""
    from cbtrace.capture.from_spec import capture_model
    from cbtrace.cost.calibrate import calibrate
    from cbtrace.global_state import restore_globals

    d = tmp_path_factory.mktemp("globals")
    out, saved = {}, read_globals()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CBTRACE_CALIBRATION", str(d / "calibration.json"))  # none stored yet
        mp.setenv("CBTRACE_CONFIG_DIR", str(d / "config"))
        try:
            model = _tiny().eval()  # eval: the step itself draws no random numbers
            x = torch.randn(2, 4)

            def run(name, fn):
                _caller_settings()
                before = read_globals()
                fn()
                out[name] = (before, read_globals())

            def capture():
                with cbtrace.capture(model, d / "run", trace=False):
                    model(x)

            run("capture", capture)
            run("capture_model", lambda: capture_model("dlrm:tiny", d / "spec_run", device="cpu",
                                                       warmup=0, trace=False))
            run("replay_first_calibrates",
                lambda: cbtrace.replay(d / "run", model=model, **FAST_REPLAY))
            assert (d / "calibration.json").is_file()  # the first replay did calibrate
            run("calibrate", lambda: calibrate("cpu", out=d / "again.json"))
        finally:
            restore_globals(saved)
    return out


ENTRIES = ("capture", "capture_model", "replay_first_calibrates", "calibrate")


@pytest.mark.parametrize("name", sorted(GLOBALS))
@pytest.mark.parametrize("entry", ENTRIES)
def test_an_entry_point_leaves_it_as_found(entry_points, entry, name):
    before, after = entry_points[entry]
    assert same_value(before[name], after[name]), f"{entry} changed {name}"


def test_a_first_replay_draws_from_its_own_rng_not_the_callers(entry_points):
    """The known bug: without the guard, calibrating moved torch.get_rng_state()."""
    before, after = entry_points["replay_first_calibrates"]
    assert torch.equal(before["torch_rng"], after["torch_rng"])
    seeded = torch.Generator().manual_seed(7).get_state()
    assert torch.equal(seeded, after["torch_rng"])  # the caller's seed 7, nothing drawn since
