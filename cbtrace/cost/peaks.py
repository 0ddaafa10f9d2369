"""Device peaks: a datasheet table (dense, not sparsity, figures) and the calibrated-peaks store.

Each device is registered once, with the datasheet URL beside its numbers (torchtitan
``get_peak_flops`` style); a second registration of a name raises at once. A device is chosen by
matching ``torch.cuda.get_device_name()`` strings. NVIDIA datasheets quote tensor-core TF32/BF16/
FP16/FP8 "with sparsity"; the figures here are those halved. ``cbtrace calibrate`` stores measured
figures in ``~/.cache/cbtrace/calibration.json`` (env ``CBTRACE_CALIBRATION`` overrides), keyed by
device name; CPUs have only calibrated peaks.
"""
from __future__ import annotations

import json
import os
import platform
import re
from dataclasses import dataclass
from pathlib import Path

from cbtrace.cost.dtypes import peak_key
from cbtrace.errors import CbtraceError

T = 1e12


@dataclass(frozen=True)
class Peak:
    flops_per_s: float | None  # None: no figure for this dtype (e.g. fp8 on an A100)
    bytes_per_s: float | None  # memory bandwidth
    source: str                # datasheet URL, or "calibrated <file> <date>"
    calibrated: bool


@dataclass(frozen=True)
class DevicePeaks:
    key: str                  # "h100-sxm"
    pattern: str              # regex matched (case-insensitive) against the device name
    flops_per_s: dict         # peak key (dtypes.PEAK_KEYS: "fp32", "tf32", "bf16", ...) -> FLOP/s, dense
    bytes_per_s: float        # HBM / DRAM bandwidth
    url: str                  # datasheet the numbers come from


DATASHEET: dict[str, DevicePeaks] = {}


def register_device(peaks: DevicePeaks) -> DevicePeaks:
    if peaks.key in DATASHEET:
        raise ValueError(f"device peaks for {peaks.key} registered twice")
    DATASHEET[peaks.key] = peaks
    return peaks


# Order matters: the first pattern that matches a name wins (NVL/PCIe before the plain name).
register_device(DevicePeaks(  # H200 NVL: 60 FP32, TF32 835*, BF16/FP16 1671*, FP8 3341* (*sparse), 4.8 TB/s
    "h200-nvl", r"H200.*NVL", {"fp32": 60 * T, "tf32": 417.5 * T, "bf16": 835.5 * T, "fp16": 835.5 * T,
                              "fp8": 1670.5 * T}, 4.8e12, "https://www.nvidia.com/en-us/data-center/h200/"))
register_device(DevicePeaks(  # H200 SXM: 67 FP32, TF32 989*, BF16/FP16 1979*, FP8 3958*, 4.8 TB/s
    "h200-sxm", r"H200", {"fp32": 67 * T, "tf32": 494.5 * T, "bf16": 989.5 * T, "fp16": 989.5 * T,
                         "fp8": 1979 * T}, 4.8e12, "https://www.nvidia.com/en-us/data-center/h200/"))
register_device(DevicePeaks(  # H100 NVL: 60 FP32, TF32 835*, BF16/FP16 1671*, FP8 3341*, 3.9 TB/s
    "h100-nvl", r"H100.*NVL", {"fp32": 60 * T, "tf32": 417.5 * T, "bf16": 835.5 * T, "fp16": 835.5 * T,
                              "fp8": 1670.5 * T}, 3.9e12, "https://www.nvidia.com/en-us/data-center/h100/"))
register_device(DevicePeaks(  # H100 PCIe: 51 FP32, TF32 756*, BF16/FP16 1513*, FP8 3026*, 2.0 TB/s
    "h100-pcie", r"H100.*PCIe", {"fp32": 51 * T, "tf32": 378 * T, "bf16": 756.5 * T, "fp16": 756.5 * T,
                                "fp8": 1513 * T}, 2.0e12, "https://www.nvidia.com/en-us/data-center/h100/"))
register_device(DevicePeaks(  # H100 SXM5 ("NVIDIA H100 80GB HBM3"): 67 FP32, TF32 989*, BF16 1979*, 3.35 TB/s
    "h100-sxm", r"H100", {"fp32": 67 * T, "tf32": 494.5 * T, "bf16": 989.5 * T, "fp16": 989.5 * T,
                         "fp8": 1979 * T}, 3.35e12, "https://www.nvidia.com/en-us/data-center/h100/"))
_A100 = "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf"
_A100_FLOPS = {"fp32": 19.5 * T, "tf32": 156 * T, "bf16": 312 * T, "fp16": 312 * T}  # TF32 312*, BF16 624*
register_device(DevicePeaks("a100-pcie-80gb", r"A100.*80GB.*PCIE|A100.*PCIE.*80GB", _A100_FLOPS, 1.935e12, _A100))
register_device(DevicePeaks("a100-pcie-40gb", r"A100.*PCIE", _A100_FLOPS, 1.555e12, _A100))
register_device(DevicePeaks("a100-sxm-80gb", r"A100.*80GB|A100.*PG509-210", _A100_FLOPS, 2.039e12, _A100))
register_device(DevicePeaks("a100-sxm-40gb", r"A100", _A100_FLOPS, 1.555e12, _A100))
register_device(DevicePeaks(  # L4: 30.3 FP32, TF32 120*, BF16/FP16 242*, FP8 485*, 300 GB/s
    "l4", r"\bL4\b", {"fp32": 30.3 * T, "tf32": 60 * T, "bf16": 121 * T, "fp16": 121 * T, "fp8": 242.5 * T},
    0.3e12, "https://www.nvidia.com/en-us/data-center/l4/"))
register_device(DevicePeaks(  # HGX B200, per GPU: TF32 2.2P*, BF16 4.5P*, FP8 9P* (sparse), 75 FP32, 8 TB/s
    "b200", r"B200", {"fp32": 75 * T, "tf32": 1100 * T, "bf16": 2250 * T, "fp16": 2250 * T, "fp8": 4500 * T},
    8.0e12, "https://www.nvidia.com/en-us/data-center/hgx/"))
register_device(DevicePeaks(  # MI300X: 163.4 FP32 matrix, TF32 653.7, BF16/FP16 1307.4, FP8 2614.9 (dense), 5.3 TB/s
    "mi300x", r"MI300X", {"fp32": 163.4 * T, "tf32": 653.7 * T, "bf16": 1307.4 * T, "fp16": 1307.4 * T,
                          "fp8": 2614.9 * T}, 5.3e12,
    "https://www.amd.com/en/products/accelerators/instinct/mi300/mi300x.html"))

def match_device(device_name: str) -> DevicePeaks | None:
    """The datasheet entry whose pattern matches ``device_name`` first, or None."""
    for peaks in DATASHEET.values():
        if re.search(peaks.pattern, device_name or "", re.IGNORECASE):
            return peaks
    return None


def calibration_path() -> Path:
    return Path(os.environ.get("CBTRACE_CALIBRATION") or Path.home() / ".cache" / "cbtrace" / "calibration.json")


def load_calibration(path: Path | None = None) -> dict:
    """device name -> calibration entry; {} when no file was written yet."""
    path = Path(path) if path else calibration_path()
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CbtraceError(f"{path}: unreadable calibration file ({e}); rerun `cbtrace calibrate`") from e
    if not isinstance(data, dict):
        raise CbtraceError(f"{path}: calibration file is not a JSON object; rerun `cbtrace calibrate`")
    return data


def save_calibration(device_name: str, entry: dict, path: Path | None = None) -> Path:
    """Store one device's entry (other devices' entries are kept)."""
    path = Path(path) if path else calibration_path()
    data = load_calibration(path)
    data[device_name] = entry
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True))
    tmp.replace(path)
    return path


def peak_for(device_name: str, dtype, *, calibrated: bool = False, path: Path | None = None) -> Peak | None:
    """Peak FLOP/s for ``dtype`` and bandwidth of a device; None if the device is unknown.

    Args:
        device_name: e.g. "NVIDIA H200", "NVIDIA A100-SXM4-80GB", or ``device_name("cpu")``.
        dtype: compute dtype ("bf16", "bfloat16", "tf32", torch.float16, ...).
        calibrated: read the measured figures written by ``cbtrace calibrate`` instead.
    """
    key = peak_key(dtype)
    if calibrated:
        entry = load_calibration(path).get(device_name)
        if entry is None:
            return None
        flops = (entry.get("matmul_flops_per_s") or {}).get(key) if key else None
        where = Path(path) if path else calibration_path()
        return Peak(flops, entry.get("copy_bytes_per_s"), f"calibrated {where} {entry.get('measured_at', '')}".strip(),
                    True)
    peaks = match_device(device_name)
    if peaks is None:
        return None
    return Peak(peaks.flops_per_s.get(key) if key else None, peaks.bytes_per_s, peaks.url, False)


class PeakLookup:
    """One device's peaks by dtype, each looked up once (a calibrated lookup reads a file).

    Calling it gives the one peak MFU, HFU, MBU and the bound divide by, in replay and
    attribution alike: the datasheet's, else the calibrated one (a CPU has only that); a call
    without a floating compute dtype is judged against the fp32 peak.
    """

    def __init__(self, device_name: str | None, *, path: Path | None = None):
        self.device_name, self._path = device_name, path
        self._cache: dict = {}

    def _get(self, dtype, calibrated: bool) -> Peak | None:
        key = (dtype, calibrated)
        if key not in self._cache:
            self._cache[key] = peak_for(self.device_name, dtype, calibrated=calibrated,
                                        path=self._path) if self.device_name else None
        return self._cache[key]

    def datasheet(self, dtype) -> Peak | None:
        return self._get(dtype or "float32", False)

    def calibrated(self, dtype) -> Peak | None:
        return self._get(dtype or "float32", True)

    def __call__(self, dtype) -> Peak | None:
        return self.datasheet(dtype) or self.calibrated(dtype)


def utilisation_peak(device_name: str | None, dtype, *, path: Path | None = None) -> Peak | None:
    """``PeakLookup(device_name)(dtype)``: the peak utilisation figures divide by."""
    return PeakLookup(device_name, path=path)(dtype)


def device_name(device="cpu") -> str:
    """The name peaks are keyed by: the CUDA device name, or "cpu: <model name>" on CPU."""
    device = str(device)
    if device.startswith("cuda"):
        import torch  # here only: attribution reads peaks without torch

        index = int(device.split(":")[1]) if ":" in device else torch.cuda.current_device()
        return torch.cuda.get_device_name(index)
    return f"cpu: {_cpu_model()}"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"
