"""One MFU per call: replay (replay/derive.py) and in-situ attribution divide the same FLOPs,
bytes and time by the same peak (cost.peaks.PeakLookup: datasheet, else calibrated) through the
same formula (cost.metrics)."""
import json
from types import SimpleNamespace

import numpy as np
import pytest

from cbtrace.attribution.attribute import attribute
from cbtrace.cost import metrics
from cbtrace.cost.peaks import PeakLookup, save_calibration, utilisation_peak
from cbtrace.replay.derive import add_utilisation

FLOPS = 2 * 64 * 128 * 256  # aten::mm (64 x 128) @ (128 x 256)
KERNEL_US = 10


def _trace(tmp_path, device: str):
    """One step: module ``lin`` runs an fp32 mm whose kernel takes KERNEL_US."""
    def x(name, ts, dur, cat="user_annotation", pid=1, tid=1, **args):
        return {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": ts,
                "dur": dur, "args": args}

    events = [x("ProfilerStep#1", 0, 100), x("cbtrace::lin", 10, 50),
              x("aten::mm", 15, 20, cat="cpu_op", **{"Input Dims": [[64, 128], [128, 256]],
                                                     "Input type": ["float", "float"]}),
              x("cudaLaunchKernel", 20, 5, cat="cuda_runtime", correlation=1),
              x("gemm", 30, KERNEL_US, cat="kernel", pid=0, tid=7, correlation=1)]
    p = tmp_path / "t.json"
    p.write_text(json.dumps({"traceEvents": events, "deviceProperties": [{"name": device}]}))
    return p


def _replayed(row, device: str):
    rec = SimpleNamespace(isolated_ms=row.gpu_ms, compute_dtype=row.compute_dtype,
                          flops=row.flops, flops_executed=row.flops_executed, bytes=row.bytes,
                          host_ms=None, kernel_count=1, mfu=None, hfu=None, mbu=None,
                          mfu_calibrated=None, mbu_calibrated=None, figures_suspect=None,
                          bound=None)
    add_utilisation(rec, device)
    return rec


@pytest.fixture
def calibration(tmp_path, monkeypatch):
    path = tmp_path / "calibration.json"
    monkeypatch.setenv("CBTRACE_CALIBRATION", str(path))
    return path


@pytest.mark.parametrize("device, peak_flops", [("NVIDIA H200", 67e12),  # datasheet fp32
                                                ("Lab Accelerator 1", 2e12)])  # calibrated only
def test_replay_and_attribution_give_one_mfu(tmp_path, calibration, device, peak_flops):
    save_calibration("Lab Accelerator 1", {"matmul_flops_per_s": {"fp32": 2e12},
                                           "copy_bytes_per_s": 1e11}, calibration)
    df = attribute(_trace(tmp_path, device), aggregate=False, workers=1)
    row = df[df.fqn == "lin"].iloc[0]
    assert row.flops == FLOPS and row.compute_dtype == "float32"
    rec = _replayed(row, device)
    assert row.mfu == pytest.approx(FLOPS / (KERNEL_US * 1e-6) / peak_flops, rel=1e-12)
    assert rec.mfu == pytest.approx(row.mfu, rel=1e-12)
    assert rec.mbu == pytest.approx(row.mbu, rel=1e-12) and not np.isnan(row.mbu)
    assert rec.hfu == pytest.approx(FLOPS / (KERNEL_US * 1e-6) / peak_flops, rel=1e-12)


def test_one_peak_rule(calibration):
    save_calibration("NVIDIA H200", {"matmul_flops_per_s": {"bf16": 7e14}}, calibration)
    save_calibration("cpu: x", {"matmul_flops_per_s": {"fp32": 1e11}, "copy_bytes_per_s": 2e10},
                     calibration)
    peaks = PeakLookup("NVIDIA H200")
    assert peaks("bfloat16").flops_per_s == 989.5e12 and not peaks("bfloat16").calibrated
    assert peaks.calibrated("bfloat16").flops_per_s == 7e14
    assert peaks(None).flops_per_s == 67e12  # no floating dtype: the fp32 peak
    cpu = utilisation_peak("cpu: x", "float32")
    assert (cpu.flops_per_s, cpu.bytes_per_s, cpu.calibrated) == (1e11, 2e10, True)
    assert utilisation_peak("cpu: not calibrated", "float32") is None
    assert utilisation_peak(None, "float32") is None


def test_metrics_take_arrays_as_scalars():
    got = metrics.mfu(np.array([1e9, 1e9, np.nan, 1e9]), np.array([1e-3, 0, 1e-3, 1e-3]),
                      np.array([1e12, 1e12, 1e12, np.nan]))
    assert got[0] == metrics.mfu(1e9, 1e-3, 1e12) == 1.0
    assert np.isnan(got[1:]).all()
    assert metrics.mfu(1e9, 0.0, 1e12) is None and metrics.mfu(float("nan"), 1e-3, 1e12) is None
