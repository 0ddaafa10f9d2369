"""``manifest.json``: the run directory's typed record, declared once (msgspec Structs).

Decoding validates in one pass and a wrong type is one line naming the field
(``Expected `int`, got `str` - at `$.num_calls```). Run settings (``step``: how cbtrace ran the
provider's step) are kept apart from the provider's own options (``model.options``), so a
provider option called ``device`` or ``step`` is the provider's. Schema version 1 (cbtrace
0.1 before this schema: one flat object, provider options and run settings mixed) is read
through ``upgrade_v1``.
"""
from __future__ import annotations

import platform
import socket
import time
from typing import Any, Literal

import msgspec

from cbtrace._version import __version__
from cbtrace.errors import RunDirError

SCHEMA_VERSION = 2


class Environment(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Where the capture ran."""

    cbtrace_version: str
    torch_version: str
    cuda_version: str | None = None
    python_version: str
    hostname: str


class ModelSource(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """What was captured: a provider spec and its options, or a live model (spec None)."""

    model_class: str                     # "cbtrace.plugins.providers.nanogpt.GPT"
    spec: str | None = None              # provider spec that built it ("nanogpt:tiny", file.py:fn)
    options: dict[str, Any] = {}         # the provider's options, as given (-o KEY=VALUE)
    seed: int | None = None              # the seed the provider built model and batch with
    compiled: bool = False               # torch.compile'd parts, captured running eagerly


class StepSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """How ``cbtrace capture`` ran the provider's step (absent for ``cbtrace.capture``)."""

    device: str                          # "cpu", "cuda:0"
    dtype: str | None = None             # --dtype: the model and float inputs cast to it
    step: Literal["forward", "train"] = "forward"
    warmup: int = 1                      # uncaptured steps run first


class CaptureSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The capture's own settings (``CaptureConfig``)."""

    include: list[str] = []
    exclude: list[str] = []
    max_depth: int | None = None
    synthesize_above_bytes: int | None = None
    max_pending_bytes: int | None = None
    trace: bool = True                   # the step ran under torch.profiler, trace written
    with_stack: bool = True              # ... with Python frames (what runs without the field did)
    worker_name: str | None = None


class Distributed(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The capture was one rank of a torch.distributed job: this run is its shard."""

    rank: int
    world_size: int


class ReplayInfo(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The last replay of the run."""

    device: str
    device_name: str
    timer_requested: str
    cold: bool = False
    timers_used: list[str] = []
    wall_s: float                        # the whole replay() up to writing this manifest
    #   (runs replayed before outside_s existed: the per-call loop and finalize only)
    torch_version: str
    timings_s: dict[str, float] = {}     # the per-call loop's seconds: load, prepare, each
    #   step, state_guard (StateGuard.call per call), loop_other (progress rows, the bar)
    outside_s: dict[str, float] = {}     # the rest of wall_s: load_run, rebuild, verify_state,
    #   verify_inputs, calibrate, state_copy (StateGuard's copy of every parameter),
    #   compile_ahead (replay/modes/precompile.py), setup, finalize, write (modules.parquet), other
    ranks: int = 1                       # processes it was sharded over (torchrun)
    compile_ahead: str | None = None     # what compiling ahead in workers did, or why it did not


class Manifest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One run directory's facts. Paths are relative to the run directory."""

    schema_version: int = SCHEMA_VERSION
    created: str                          # local time of the capture, ISO 8601
    environment: Environment
    device: str                           # where the model's parameters were
    device_name: str                      # cbtrace.cost.peaks.device_name of it
    model: ModelSource
    step: StepSettings | None = None
    capture: CaptureSettings = msgspec.field(default_factory=CaptureSettings)
    torch_initial_seed: int | None = None
    num_calls: int = 0
    capture_step_s: float | None = None
    capture_timings_s: dict[str, float] = {}  # where capture time went
    state_sha256: str | None = None       # parameters and buffers before the step
    #   (cbtrace.state.state_digest; "v3:" samples tensors above 64 KiB, "v2:" above 4 MiB)
    training_flags: dict[str, bool] = {}  # module.training of every submodule, by fqn
    trace: str | None = None              # the capture's Kineto trace
    input_files: list[str] = []           # inputs/tensors-NNNNN.parquet shards
    input_bytes_written: int = 0
    complete: bool = True                 # False: the step or the writes failed (see error)
    error: str | None = None
    files: dict[str, str] = {}            # sha256 of every file of the run
    files_stat: dict[str, tuple[int, int]] = {}  # (size, mtime_ns) when hashed
    replay: ReplayInfo | None = None
    distributed: Distributed | None = None  # rank and world size of the capturing job
    synthetic_figures: bool = False       # test data made by tests/helpers/sample_runs.py

    @property
    def title(self) -> str:
        """How the run is named in reports: the spec, else the model's class name."""
        return self.model.spec or self.model.model_class.rpartition(".")[2]


def environment() -> Environment:
    """This process's versions and host."""
    import torch  # here: `cbtrace <cmd> --help` imports this module and must stay light

    return Environment(cbtrace_version=__version__, torch_version=str(torch.__version__),
                       cuda_version=torch.version.cuda, python_version=platform.python_version(),
                       hostname=socket.gethostname())


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


def encode(manifest: Manifest) -> bytes:
    """Indented JSON, keys in declaration order."""
    return msgspec.json.format(msgspec.json.encode(manifest), indent=2) + b"\n"


def decode(data: bytes, source) -> Manifest:
    """A manifest from JSON bytes; RunDirError (one line, naming ``source``) if it is not one."""
    try:
        raw = msgspec.json.decode(data)
    except msgspec.DecodeError as e:
        raise RunDirError(f"{source}: corrupt manifest ({e})") from None
    if not isinstance(raw, dict):
        raise RunDirError(f"{source}: corrupt manifest (not a JSON object)")
    version = raw.get("schema_version", 1)
    if not isinstance(version, int) or version > SCHEMA_VERSION:
        raise RunDirError(f"{source}: manifest schema version {version!r} is newer than this "
                          f"cbtrace reads ({SCHEMA_VERSION}); upgrade cbtrace")
    if version == 1:
        raw = upgrade_v1(raw)
    try:
        return msgspec.convert(raw, Manifest)
    except msgspec.ValidationError as e:
        raise RunDirError(f"{source}: invalid manifest: {e}") from None


def upgrade_v1(raw: dict) -> dict:
    """A schema-1 manifest as schema 2: ``options`` held the CaptureConfig with the provider
    options and run settings mixed in ``options.options``; environment fields were top-level."""
    env_keys = ("cbtrace_version", "torch_version", "cuda_version", "python_version", "hostname")
    out = {k: v for k, v in raw.items() if k not in (*env_keys, "options", "seeds",
                                                     "model_spec", "model_class")}
    out["schema_version"] = SCHEMA_VERSION
    out["environment"] = {k: raw[k] for k in env_keys if k in raw}
    cfg = raw.get("options") if isinstance(raw.get("options"), dict) else {}
    opts = dict(cfg.get("options") or {}) if isinstance(cfg.get("options"), dict) else {}
    run = {k: opts.pop(k) for k in ("device", "dtype", "step", "warmup") if k in opts}
    seeds = raw.get("seeds") if isinstance(raw.get("seeds"), dict) else {}
    out["model"] = {"model_class": raw.get("model_class"), "spec": raw.get("model_spec"),
                    "options": opts, "seed": seeds.get("provider_seed", cfg.get("seed"))}
    out["torch_initial_seed"] = seeds.get("torch_initial_seed")
    if raw.get("model_spec") and "device" in run:
        out["step"] = run
    out["capture"] = {"include": cfg.get("include", []), "exclude": cfg.get("exclude", []),
                      "max_depth": cfg.get("max_depth"),
                      "synthesize_above_bytes": cfg.get("synthesize_above_bytes"),
                      "max_pending_bytes": cfg.get("max_pending_bytes"),
                      "trace": cfg.get("profile", True), "worker_name": cfg.get("worker_name")}
    replay = raw.get("replay")
    if isinstance(replay, dict):  # the earliest replays wrote "timer", not "timer_requested"
        replay = dict(replay)
        replay.setdefault("timer_requested", replay.pop("timer", "auto"))
        replay.pop("timer", None)
        out["replay"] = replay
    return out
