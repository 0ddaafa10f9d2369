"""cbtrace.annotate.trace_handler in a user's own torch.profiler loop."""
from __future__ import annotations

import pytest

from helpers.annotate_data import load_trace, module_calls, tiny_model

import cbtrace


def _train(on_trace_ready, steps: int = 3):
    import torch
    from torch.profiler import ProfilerActivity, profile, schedule

    model = tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(8, 16, 64)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True, with_stack=True,
                 with_modules=True, schedule=schedule(wait=0, warmup=1, active=2, repeat=1),
                 on_trace_ready=on_trace_ready) as prof:
        for _ in range(steps):
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
            prof.step()


def test_trace_handler_writes_trace_and_annotated_trace(tmp_path):
    _train(cbtrace.trace_handler(tmp_path / "log", worker_name="w0"))
    files = sorted(p.name for p in (tmp_path / "log").iterdir())
    assert len(files) == 2 and files[0].startswith("annotated_w0.") and files[1].startswith("w0.")
    assert all(f.endswith(".pt.trace.json.gz") for f in files)
    orig = load_trace(tmp_path / "log" / files[1])
    ann = load_trace(tmp_path / "log" / files[0])
    assert "cbtrace" not in orig and ann["cbtrace"]["source_trace"] == files[1]
    mods = [e for e in ann["traceEvents"] if e.get("name", "").startswith("nn.Module: ")]
    assert len(mods) == 2 * len(module_calls())  # 2 active steps
    for e in mods:  # in-situ time, FLOPs (Linear) from attribution, and the module path
        assert e["args"]["insitu_ms"] > 0 and e["args"]["fqn"].startswith("Net_0")
    assert all(e["args"]["flops"] > 0 for e in mods if "Linear" in e["name"])
    assert any(e.get("ph") == "C" for e in ann["traceEvents"])


def test_trace_handler_plain_json_and_default_worker(tmp_path):
    _train(cbtrace.trace_handler(str(tmp_path), use_gzip=False))
    names = sorted(p.name for p in tmp_path.iterdir())
    assert len(names) == 2 and all(n.endswith(".pt.trace.json") for n in names)
    assert names[0] == "annotated_" + names[1]


def test_trace_handler_never_breaks_training(tmp_path, monkeypatch):
    from cbtrace.annotate import write as mod

    def boom(**kw):
        raise mod.TraceError("simulated failure")

    monkeypatch.setattr(mod, "annotate", boom)
    with pytest.warns(UserWarning, match="was not annotated"):
        _train(cbtrace.trace_handler(tmp_path))
    assert len(list(tmp_path.iterdir())) == 1
