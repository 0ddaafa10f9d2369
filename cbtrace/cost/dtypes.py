"""ONE table of dtype spellings: torch dtypes, canonical names, Kineto strings, CLI and peak keys.

Every spelling of a dtype resolves to one ``DType`` row:
- a torch.dtype or its ``str`` ("torch.bfloat16"), and torch's aliases ("half", "cfloat");
- the canonical name, ``str(torch.bfloat16)`` without "torch." ("bfloat16");
- Kineto's "Input type" strings (``c10::TypeMeta`` names: "float", "c10::BFloat16", "long int");
- the short names of ``--dtype`` ("fp32", "bf16", "fp16").
"tf32" is a row too: a compute dtype (fp32 storage run on TF32 tensor cores), not a storage one.
Torch is imported only by ``torch_dtype``: attribution reads traces without it.
"""
from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass


@dataclass(frozen=True)
class DType:
    name: str                      # canonical: "bfloat16"
    itemsize: int                  # bytes per element
    floating: bool                 # torch's is_floating_point (complex is not)
    peak_key: str | None           # its column in the peak table (cost/peaks.py); None: no peak
    kineto: tuple[str, ...] = ()   # Kineto "Input type" spellings of a tensor of this dtype
    aliases: tuple[str, ...] = ()  # torch attribute aliases and --dtype short names
    torch_name: str | None = None  # the torch attribute, where not ``name`` ("tf32": float32)


DTYPES: dict[str, DType] = {}       # canonical name -> row
_SPELLINGS: dict[str, DType] = {}   # every spelling (canonical, Kineto, alias) -> row
_KINETO: dict[str, str] = {}        # Kineto spelling or canonical name -> canonical name
PEAK_KEYS = ("fp32", "tf32", "bf16", "fp16", "fp8")
CLI_DTYPES = ("fp32", "float32", "bf16", "bfloat16", "fp16", "float16")  # --dtype choices


def register_dtype(row: DType) -> DType:
    """Add a row; a spelling already taken by another row raises at once."""
    for s in {row.name, *row.kineto, *row.aliases}:
        if s in _SPELLINGS:
            raise ValueError(f"dtype spelling {s!r} registered twice")
        _SPELLINGS[s] = row
    for s in (row.name, *row.kineto):
        _KINETO[s] = row.name
    DTYPES[row.name] = row
    return row


for _row in (
    DType("float32", 4, True, "fp32", ("float",), ("fp32",)),
    DType("float64", 8, True, None, ("double",)),
    DType("float16", 2, True, "fp16", ("c10::Half",), ("fp16", "half")),
    DType("bfloat16", 2, True, "bf16", ("c10::BFloat16",), ("bf16",)),
    DType("tf32", 4, True, "tf32", torch_name="float32"),
    DType("float8_e4m3fn", 1, True, "fp8", ("c10::Float8_e4m3fn",)),
    DType("float8_e5m2", 1, True, "fp8", ("c10::Float8_e5m2",)),
    DType("float8_e4m3fnuz", 1, True, "fp8", ("c10::Float8_e4m3fnuz",)),
    DType("float8_e5m2fnuz", 1, True, "fp8", ("c10::Float8_e5m2fnuz",)),
    DType("float8_e8m0fnu", 1, True, None, ("c10::Float8_e8m0fnu",)),  # a scale format: no peak
    DType("int64", 8, False, None, ("long int", "long")),
    DType("int32", 4, False, None, ("int",)),
    DType("int16", 2, False, None, ("short int", "short")),
    DType("int8", 1, False, None, ("signed char",)),
    DType("uint8", 1, False, None, ("unsigned char",)),
    DType("uint16", 2, False, None, ("short unsigned int",)),
    DType("uint32", 4, False, None, ("unsigned int",)),
    DType("uint64", 8, False, None, ("long unsigned int",)),
    DType("bool", 1, False, None, ("bool",)),
    DType("complex64", 8, False, None, ("c10::complex<float>",), ("cfloat",)),
    DType("complex128", 16, False, None, ("c10::complex<double>",), ("cdouble",)),
    DType("complex32", 4, False, None, ("c10::complex<c10::Half>",), ("chalf",)),
):
    register_dtype(_row)


def _text(dtype) -> str:
    s = str(dtype)
    return s[6:] if s.startswith("torch.") else s


@functools.lru_cache(maxsize=256)
def lookup(dtype) -> DType | None:
    """The row of any spelling (torch.dtype, "torch.half", "bf16", "c10::Half"); None if unknown."""
    return None if dtype is None else _SPELLINGS.get(_text(dtype))


@functools.lru_cache(maxsize=256)
def name_of(dtype) -> str | None:
    """Canonical name: torch.bfloat16, "torch.bfloat16", "bf16", "c10::BFloat16" -> "bfloat16".

    A spelling not in the table comes back as its text without "torch." (torch.quint8 ->
    "quint8"), so every torch dtype has a name that ``torch_dtype`` turns back into it.
    """
    if dtype is None:
        return None
    row = lookup(dtype)
    return row.name if row else _text(dtype)


def kineto_name(input_type: str) -> str | None:
    """A Kineto "Input type" of a tensor ("c10::BFloat16", or a canonical name) -> "bfloat16";
    None for a non-tensor input ("Scalar", "TensorList", "")."""
    return _KINETO.get(input_type)


def itemsize(dtype) -> int:
    """Bytes per element; 4 for a dtype not in the table."""
    row = lookup(dtype)
    return row.itemsize if row else 4


def meta_bytes(metas_json: str | None) -> int:
    """Bytes of the tensors a record's ``input_meta`` / ``output_meta`` (a JSON list of
    {shape, dtype, ...}) describes; 0 for what does not parse."""
    try:
        metas = json.loads(metas_json or "[]")
        return sum(math.prod(m.get("shape", [])) * itemsize(m.get("dtype", "float32"))
                   for m in metas if isinstance(m, dict))
    except (ValueError, TypeError, AttributeError):
        return 0


def is_floating(dtype) -> bool:
    """True for float, half, bfloat16, fp8 and tf32 spellings; False for others and unknown ones."""
    row = lookup(dtype)
    return bool(row and row.floating)


def peak_key(dtype) -> str | None:
    """The peak table's key: torch.float32 / "bfloat16" / "tf32" / "fp8" -> "fp32" / "bf16" /
    "tf32" / "fp8"; None for dtypes without a peak (integers, float64)."""
    if dtype in PEAK_KEYS:
        return dtype
    row = lookup(dtype)
    return row.peak_key if row else None


def torch_dtype(dtype):
    """torch.dtype of any spelling ("fp32", "bfloat16", "c10::Half", "tf32" -> torch.float32).

    Raises:
        ValueError: naming ``dtype`` and listing the --dtype names, when no torch dtype has it.
    """
    import torch  # here only: attribution reads dtypes without torch

    if isinstance(dtype, torch.dtype):
        return dtype
    row = lookup(dtype)
    attr = (row.torch_name or row.name) if row else _text(dtype) if isinstance(dtype, str) else None
    found = getattr(torch, attr, None) if attr else None
    if not isinstance(found, torch.dtype):
        raise ValueError(f"dtype {dtype!r}: not a dtype this torch knows; expected one of "
                         f"{', '.join(CLI_DTYPES)} (or another torch dtype name)")
    return found
