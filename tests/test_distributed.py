"""torch.distributed on CPU (gloo, 2 processes, started by real torchrun): sharded replay, a
killed rank resumed, and a 2-rank DDP capture that writes one shard per rank."""
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pandas as pd
import pytest

from cbtrace.capture.from_spec import capture_model

pytestmark = pytest.mark.slow
FAST = ["--budget-s", "0.002", "--timeout-s", "120"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return capture_model("dlrm:tiny", tmp_path_factory.mktemp("d") / "run", device="cpu").out


def cbtrace(*args, **kw):
    return subprocess.run([sys.executable, "-m", "cbtrace", *args], capture_output=True,
                          text=True, timeout=600, **kw)


def table(run):
    return pd.read_parquet(Path(run) / "modules.parquet").sort_values("call_id")


def test_sharded_replay_gives_the_rows_of_one_process_with_work_on_both_ranks(run):
    one = cbtrace("replay", str(run), *FAST)
    assert one.returncode == 0, one.stderr[-2000:]
    single = table(run)
    two = cbtrace("replay", str(run), "--nproc", "2", *FAST)
    assert two.returncode == 0, two.stderr[-3000:]
    sharded = table(run)
    cols = ["call_id", "fqn", "call_index", "status"]
    assert sharded[cols].values.tolist() == single[cols].values.tolist()
    assert set(sharded["rank"]) == {0, 1} and (sharded["status"] == "ok").all()
    assert sharded["isolated_ms"].notna().all() and sharded["flops"].notna().all()
    assert "calls: ok 47" in two.stdout  # rank 0 reports for both
    m = json.loads((Path(run) / "manifest.json").read_text())
    assert m["replay"]["ranks"] == 2


def test_torchrun_runs_the_replay_module_on_each_rank(run):
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc-per-node", "2", "-m", "cbtrace.replay", str(run), *FAST],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert set(table(run)["rank"]) == {0, 1}


def _rank_pids(run: Path) -> dict[int, int]:
    """rank -> pid of the replay workers torchrun started for ``run``."""
    pids = {}
    for proc in Path("/proc").iterdir():
        try:
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
            env = dict(x.split(b"=", 1) for x in (proc / "environ").read_bytes().split(b"\0")
                       if b"=" in x)
        except OSError:
            continue
        if b"cbtrace.replay" in cmd and str(run).encode() in cmd and b"RANK" in env:
            pids[int(env[b"RANK"])] = int(proc.name)
    return pids


def test_a_killed_rank_loses_only_its_unfinished_calls_and_resume_completes(run):
    for old in Path(run).glob("replay.progress*.jsonl"):  # the tests before left theirs
        old.unlink()
    proc = subprocess.Popen([sys.executable, "-m", "cbtrace", "replay", str(run), "--nproc", "2",
                             "--budget-s", "0.2"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    log = Path(run) / "replay.progress.rank-1.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and not (log.exists() and len(log.read_text().splitlines()) >= 3):
        time.sleep(0.1)
    os.kill(_rank_pids(Path(run))[1], signal.SIGKILL)  # rank 1 dies mid-replay
    assert proc.wait(timeout=300) != 0  # torchrun stops the job
    kept = {json.loads(x)["call_id"] for f in Path(run).glob("replay.progress*.jsonl")
            for x in f.read_text().splitlines() if x.strip()}
    assert 3 <= len(kept) < 47
    out = cbtrace("replay", str(run), "--resume", *FAST)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [json.loads(x) for f in Path(run).glob("replay.progress*.jsonl")
            for x in f.read_text().splitlines() if x.strip()]
    first = [r["call_id"] for r in rows if "timed twice" not in (r.get("timer_notes") or "")]
    assert sorted(first) == list(range(47))  # the finished calls were not redone
    assert (table(run)["status"] == "ok").all()


DDP = '''
import sys, torch, torch.distributed as dist
from torch import nn
import cbtrace
dist.init_process_group("gloo")
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
ddp = nn.parallel.DistributedDataParallel(model)
x = torch.randn(4, 8) * (dist.get_rank() + 1)
with cbtrace.capture(ddp, sys.argv[1], trace=False):
    ddp(x).pow(2).mean().backward()
dist.destroy_process_group()
'''


def test_a_ddp_capture_writes_one_shard_per_rank_and_each_replays(tmp_path):
    import torch
    from torch import nn

    import cbtrace

    script = tmp_path / "ddp.py"
    script.write_text(textwrap.dedent(DDP))
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc-per-node", "2", str(script), str(tmp_path / "job")],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    shards = sorted(p.name for p in (tmp_path / "job").iterdir())
    assert shards == ["rank-0", "rank-1"]
    for r, name in enumerate(shards):
        m = json.loads((tmp_path / "job" / name / "manifest.json").read_text())
        assert m["distributed"] == {"rank": r, "world_size": 2}
        torch.manual_seed(0)  # the same model as each rank's: DDP wraps it, names do not
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        df = cbtrace.replay(tmp_path / "job" / name, model=model, budget_s=0.002, min_runs=2,
                            backward=True, progress=False)
        assert list(df["fqn"]) == ["", "0", "1", "2"]  # the user's tree: no "module." prefix
        assert (df["status"] == "ok").all() and (df["grad_source"] == "captured").all()
