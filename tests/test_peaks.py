"""Datasheet peaks, device-name matching, the calibration store and `cbtrace calibrate`."""
import json
import time

import pytest
import torch
from click.testing import CliRunner

from cbtrace.cost import peaks
from cbtrace.cost.peaks import Peak, peak_for


@pytest.mark.parametrize("name, key", [
    ("NVIDIA H200", "h200-sxm"),
    ("NVIDIA H200 NVL", "h200-nvl"),
    ("NVIDIA H100 80GB HBM3", "h100-sxm"),
    ("NVIDIA H100 PCIe", "h100-pcie"),
    ("NVIDIA H100 NVL", "h100-nvl"),
    ("NVIDIA A100-SXM4-80GB", "a100-sxm-80gb"),
    ("NVIDIA A100-SXM4-40GB", "a100-sxm-40gb"),
    ("NVIDIA A100-PCIE-40GB", "a100-pcie-40gb"),
    ("NVIDIA A100 80GB PCIe", "a100-pcie-80gb"),
    ("NVIDIA A100-PG509-200", "a100-sxm-40gb"),   # the device in the shared HTA traces
    ("NVIDIA L4", "l4"),
    ("NVIDIA B200", "b200"),
    ("AMD Instinct MI300X", "mi300x"),
])
def test_device_names_match(name, key):
    assert peaks.match_device(name).key == key


def test_unknown_devices_and_cpu_have_no_datasheet():
    assert peaks.match_device("NVIDIA L40S") is None
    assert peak_for("cpu: AMD EPYC", "fp32") is None
    assert peak_for("Tesla V100-SXM2-32GB", "fp32") is None


def test_peak_for_by_dtype():
    # H200 SXM datasheet: BF16 1979 TFLOPS with sparsity -> 989.5 dense; 4.8 TB/s
    p = peak_for("NVIDIA H200", "bfloat16")
    assert p == Peak(989.5e12, 4.8e12, "https://www.nvidia.com/en-us/data-center/h200/", False)
    assert peak_for("NVIDIA H200", torch.float32).flops_per_s == 67e12
    assert peak_for("NVIDIA H200", "tf32").flops_per_s == 494.5e12
    assert peak_for("NVIDIA A100-SXM4-80GB", "fp8").flops_per_s is None     # no FP8 on Ampere
    assert peak_for("NVIDIA A100-SXM4-80GB", "int64").bytes_per_s == 2.039e12
    # the H200 reference measurements sit below the datasheet: 788 bf16, 405 tf32, 50.9 fp32, 4.24 TB/s
    for dtype, measured in (("bf16", 788e12), ("tf32", 405e12), ("fp32", 50.9e12)):
        assert measured < peak_for("NVIDIA H200", dtype).flops_per_s
    assert 4.24e12 < peak_for("NVIDIA H200", "bf16").bytes_per_s


def test_every_entry_cites_a_datasheet_and_registers_once():
    for entry in peaks.DATASHEET.values():
        assert entry.url.startswith("https://")
        assert entry.bytes_per_s > 0 and entry.flops_per_s["bf16"] >= entry.flops_per_s["fp32"]
    with pytest.raises(ValueError, match="registered twice"):
        peaks.register_device(peaks.DATASHEET["l4"])


def test_calibration_store_roundtrip(tmp_path, monkeypatch):
    path = tmp_path / "cal.json"
    monkeypatch.setenv("CBTRACE_CALIBRATION", str(path))
    assert peaks.calibration_path() == path
    assert peak_for("NVIDIA H200", "bf16", calibrated=True) is None
    peaks.save_calibration("NVIDIA H200", {"matmul_flops_per_s": {"bf16": 788e12, "tf32": 405e12},
                                           "copy_bytes_per_s": 4.24e12, "measured_at": "2026-01-01"})
    peaks.save_calibration("NVIDIA L4", {"matmul_flops_per_s": {}, "copy_bytes_per_s": 0.25e12})
    p = peak_for("NVIDIA H200", "bfloat16", calibrated=True)
    assert (p.flops_per_s, p.bytes_per_s, p.calibrated) == (788e12, 4.24e12, True)
    assert str(path) in p.source
    assert set(json.loads(path.read_text())) == {"NVIDIA H200", "NVIDIA L4"}
    path.write_text("not json")
    with pytest.raises(peaks.CbtraceError, match="cal.json"):
        peak_for("NVIDIA H200", "bf16", calibrated=True)


def test_calibrate_cli_on_cpu(tmp_path):
    from cbtrace.cli.main import cli

    out = tmp_path / "calibration.json"
    start = time.perf_counter()
    result = CliRunner().invoke(cli, ["calibrate", "--device", "cpu", "--out", str(out)])
    elapsed = time.perf_counter() - start
    assert result.exit_code == 0, result.output
    assert "matmul fp32" in result.output and "copy" in result.output
    # a runaway loop, not speed (benchmarks time it): each figure stops after its budget once
    # its minimum runs are in, so only a loop that never stops reaches this on a busy machine
    assert elapsed < 120
    name = peaks.device_name("cpu")
    entry = json.loads(out.read_text())[name]
    assert set(entry["matmul_flops_per_s"]) == {"fp32", "bf16"}
    p = peak_for(name, "float32", calibrated=True, path=out)
    # the figures read back are the ones measured (how fast a busy CPU was is no test's claim)
    assert p.flops_per_s == entry["matmul_flops_per_s"]["fp32"] > 0
    assert p.bytes_per_s == entry["copy_bytes_per_s"] > 0
    assert entry["matmul_n"]["fp32"] >= 256 and entry["copy_bytes"] > 0


def test_calibrate_cuda_without_gpu_is_a_clear_error(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    from cbtrace.cli.main import cli

    result = CliRunner().invoke(cli, ["calibrate", "--device", "cuda", "--out", str(tmp_path / "c.json")])
    assert result.exit_code == 1
    assert "no CUDA device" in result.output
    assert not (tmp_path / "c.json").exists()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_calibrate_gpu_is_below_datasheet(tmp_path):
    from cbtrace.cost.calibrate import calibrate

    entry = calibrate("cuda", out=tmp_path / "c.json")
    sheet = peaks.match_device(entry["name"])
    if sheet is None:
        pytest.skip(f"no datasheet entry for {entry['name']}")
    for dtype, rate in entry["matmul_flops_per_s"].items():
        assert 0.3 * sheet.flops_per_s[dtype] < rate < 1.05 * sheet.flops_per_s[dtype], dtype
    assert 0.5 * sheet.bytes_per_s < entry["copy_bytes_per_s"] < 1.05 * sheet.bytes_per_s
