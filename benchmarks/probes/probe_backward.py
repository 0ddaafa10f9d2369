"""Why a replayed backward differs from its in-situ time: kernels and timing methods, per call.

Captures one training step (``--step train``), then for a few calls gives the backward's time and
kernel count in the step (the in-situ stage's attribution of the capture trace) beside the
kernels of one replayed backward (torch.profiler), and times the
replayed backward two ways on the same prepared call:

- ``staged``: the graph timer as replay uses it (each slot's forward run eagerly on the capture
  stream, only the K backwards in the graph);
- ``events``: the events timer, the forward queued untimed before the start event;

and (GPU) one replay of the staged graph of 20 backwards profiled: its device activities by kind
and the replay's span per backward against their busy time (the gaps a graph figure holds).

(Another way, a graph of K forward+backward pairs less a graph of K forwards, was replay's
method before this probe; at 35435c8 its capture failed on every call, see RESULTS.md.)

Usage: python benchmarks/probes/probe_backward.py OUT_DIR [SPEC] [FQN ...]   (GPU; SPEC: nanogpt;
       a benchmarks/zoo.py spec is captured at its real size)
"""
import sys
from pathlib import Path

import torch

SPEC, OPTIONS = "nanogpt", {"batch_size": 8}
FQNS = ["transformer.h.0.ln_1", "transformer.h.0.attn.c_attn", "transformer.h.0.attn.c_proj",
        "transformer.h.0.mlp.c_fc", "transformer.h.0.mlp.gelu", "transformer.h.0.mlp.c_proj",
        "transformer.h.0.attn", "transformer.h.0.mlp", "transformer.h.0", "lm_head"]


def insitu_backward(run, manifest) -> dict:
    """fqn -> (ms, kernel count) of the backward the step ran for the call's first call (own
    work, not its children's), as the in-situ stage attributes it (device time on a GPU)."""
    from cbtrace.attribution.join import insitu_for_run

    t = insitu_for_run(run, manifest, phase="bwd")
    t = t[t["call_index"] == 0]
    return {f: (ms, n) for f, ms, n in zip(t["fqn"], t["insitu_ms"], t["kernel_count"])}


def replay_kernels(bwd, forward) -> list:
    """[(kernel, µs)] of one backward of copy 0 after an untimed forward (CPU: its aten ops,
    host µs: a dry run of the probe)."""
    from torch.profiler import ProfilerActivity, profile

    outs, targets = forward()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        bwd(outs, targets)
        if cuda:
            torch.cuda.synchronize()
    if not cuda:
        return [(e.name, e.cpu_time) for e in prof.events() if e.name.startswith("aten::")]
    return [(e.name, e.device_time) for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA]


def methods(c, backward, backends, tcfg):
    """ms of one backward, timed staged / with events."""
    from cbtrace.replay.timer import choice as timers
    from cbtrace.replay.modes.backward import _backward_runner

    out = {}
    bwd = _backward_runner(c, backward)
    for name, fn, timer in (("staged", bwd, "graph"), ("events", bwd, "events")):
        try:  # the timer itself, not the chain: its error keeps the one under it
            why = backends[timer].unavailable_reason(c.device)
            if why:
                raise timers.TimerUnavailable(why)
            t = backends[timer].measure(fn, c.n_copies, c.device, tcfg)
            out[name] = (t.median_ms, t.timer, t.notes or "")
        except Exception as e:  # noqa: BLE001 - report and go on
            out[name] = (float("nan"), "failed", f"{type(e).__name__}: {str(e)[:120]}")
            print_cause(name, e)
    return out


def graph_activity(c, backward, k: int = 20) -> str:
    """What one replay of the staged graph of ``k`` backwards holds, profiled: each kind of
    device activity (kernels, memsets, copies) with its count and median µs, and the replay's
    span per backward against its activities' busy time per backward (the gaps between)."""
    from torch.profiler import ProfilerActivity, profile

    from cbtrace.plugins.backends.graph import staged
    from cbtrace.replay.modes.backward import _backward_runner

    bwd = _backward_runner(c, backward)
    stream = torch.cuda.Stream()
    try:
        g = staged(bwd, c.n_copies, k, None, stream)
        g.replay()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            g.replay()
            torch.cuda.synchronize()
        g.reset()
    finally:
        bwd.unstage()
    acts = [e for e in prof.profiler.kineto_results.events()
            if e.device_type() == torch.autograd.DeviceType.CUDA]
    if not acts:
        return "  graph: no device activity recorded"
    kinds: dict = {}
    for e in acts:
        kinds.setdefault(e.name()[:60], []).append(e.duration_ns() / 1e3)
    end = max(e.start_ns() + e.duration_ns() for e in acts)
    span = (end - min(e.start_ns() for e in acts)) / 1e3
    busy = sum(sum(v) for v in kinds.values())
    lines = [f"  graph of {k}: span {span / k:.2f} us a backward, busy {busy / k:.2f} us "
             f"({len(acts)} activities)"]
    lines += [f"    {len(v):>3} x {n}: median {sorted(v)[len(v) // 2]:.2f} us"
              for n, v in kinds.items()]
    return "\n".join(lines)


def print_cause(name: str, e: BaseException) -> None:
    """The error under a failed timer's, whole: with TORCH_SHOW_CPP_STACKTRACES=1 its C++ stack
    names the op (and the autograd node) that broke the capture."""
    import traceback

    from cbtrace.replay.timer.graph_capture import root_cause

    cause = e.__cause__ or e.__context__ or e
    cause = root_cause(cause)
    print(f"  {name} failed; the error under it:")
    text = "".join(traceback.format_exception(type(cause), cause, cause.__traceback__))
    print("    " + text[-4000:].replace("\n", "\n    "))


def spec_options(spec: str, gpu: bool) -> dict:
    """The provider options the probe captures with: NanoGPT's batch, a zoo model's real size
    (on a CPU, a dry run: their defaults)."""
    if spec == SPEC:
        return OPTIONS
    return {"size": "real"} if gpu and "zoo.py:" in spec else {}


def main(out_dir, spec=SPEC, fqns=None):
    import pandas as pd

    from cbtrace import module_tree, registry
    from cbtrace.capture.from_spec import capture_model
    from cbtrace.replay.modes.backward import _Backward, _gradients, _grad_outputs
    from cbtrace.replay.measure.prepare import prepare
    from cbtrace.replay.config import ReplayConfig
    from cbtrace.rundir.read import load_run
    from cbtrace.schema.modules import frame_to_records
    from cbtrace.store.load import load_call_inputs

    fqns = fqns or FQNS
    run = Path(out_dir) / "probe"
    gpu = torch.cuda.is_available()
    device = torch.device("cuda" if gpu else "cpu")
    cap = capture_model(spec, run, device=device.type, dtype="bf16" if gpu else None,
                        options=spec_options(spec, gpu), step="train")
    model = cap.model
    manifest, df = load_run(run)
    ins = insitu_backward(run, manifest)
    cfg = ReplayConfig()
    tcfg = cfg.timing()
    backends = registry.backends()
    rows = []
    for fqn in fqns:
        rec = df[(df["fqn"] == fqn) & (df["call_index"] == 0)]
        if not len(rec):
            print(f"{fqn}: not captured")
            continue
        rec = frame_to_records(rec)[0]
        module = module_tree.get_submodule(model, rec.fqn)
        args, kwargs = load_call_inputs(run, rec.inputs_ref, device=device)
        grads = load_call_inputs(run, rec.grads_ref, device=device)[0] if rec.grads_ref else None
        module.train(bool(rec.training))
        c = prepare(module, rec, args, kwargs, device, cfg, grads)
        g, source = _gradients(c, _grad_outputs(c.run(0)))  # no graph kept (see BackwardStep)
        backward = _Backward(c, g)
        rk = replay_kernels(backward, backward.forward)
        own_ms, own_kernels = ins.get(fqn, (float("nan"), 0))
        m = methods(c, backward, backends, tcfg)
        rows.append(dict(fqn=fqn, grads=source, insitu_own_us=own_ms * 1e3,
                         insitu_kernels=own_kernels, replay_us=sum(d for _, d in rk),
                         replay_kernels=len(rk),
                         **{f"{k}_us": v[0] * 1e3 for k, v in m.items()},
                         notes=" | ".join(f"{k}: {v[1]} {v[2]}" for k, v in m.items())))
        print(f"\n== {fqn} (grads {source})")
        print(f"  in situ (own):  {own_kernels} kernels, {own_ms * 1e3:.1f} us")
        print("  replay (all):   " + "; ".join(f"{n[:60]} {d:.1f}" for n, d in rk))
        if gpu:
            try:
                print(graph_activity(c, backward))
            except Exception as e:  # noqa: BLE001 - report and go on
                print(f"  graph: not profiled ({type(e).__name__}: {str(e)[:160]})")
        for p in module.parameters():
            p.grad = None
        del c, backward
        if gpu:
            torch.cuda.empty_cache()
    t = pd.DataFrame(rows)
    print("\n== backward per call (µs); in situ: own kernels; staged/events: timed")
    print(t.drop(columns=["notes"]).to_string(index=False, float_format=lambda x: f"{x:.1f}"))
    print(t[["fqn", "notes"]].to_string(index=False))


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    main(sys.argv[1], *(sys.argv[2:3] or [SPEC]), fqns=sys.argv[3:] or None)
