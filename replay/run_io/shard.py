"""Sharded replay under torch.distributed: each rank replays its share of the calls.

Started by torchrun (``torchrun --nproc-per-node N -m cbtrace.replay RUN``, or ``cbtrace replay
RUN --nproc N``, which starts torchrun's elastic agent itself; several hosts through torchrun's
rendezvous flags). Calls go to ranks by estimated cost, longest first onto the least loaded rank
(``assign``): the replay wall of an earlier replay where the run has one, else the same for
every call (a call's fixed costs, not its size, set most of its replay wall). Each rank uses its
own GPU (``cuda:LOCAL_RANK``) or CPU process, writes its rows to its own progress file (so a rank
that dies loses only its unfinished calls, which ``--resume`` completes) and sends them to rank
0, which derives the figures over the whole tree and writes the one modules.parquet.
"""
from __future__ import annotations

import heapq
import os
from dataclasses import dataclass

import torch.distributed as dist


@dataclass(frozen=True)
class World:
    rank: int
    size: int
    local_rank: int


def world() -> World | None:
    """This process's place in a torchrun job of more than one process, else None."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size <= 1:
        return None
    return World(int(os.environ["RANK"]), size, int(os.environ.get("LOCAL_RANK", "0")))


def init(w: World, cuda: bool) -> None:
    """The process group (nccl between GPUs, gloo between CPU processes), once."""
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if cuda else "gloo")


def assign(costs: dict[int, float], ranks: int) -> dict[int, int]:
    """call_id -> rank: longest first onto the least loaded rank (ties: lower call_id, rank)."""
    load = [(0.0, r) for r in range(ranks)]
    out = {}
    for cid, cost in sorted(costs.items(), key=lambda kv: (-kv[1], kv[0])):
        total, r = heapq.heappop(load)
        out[cid] = r
        heapq.heappush(load, (total + cost, r))
    return out


def costs(df) -> dict[int, float]:
    """Estimated replay cost per call: an earlier replay's wall where known, else 1."""
    walls = df["replay_wall_s"] if "replay_wall_s" in df else None
    known = walls is not None and walls.notna().all() and (walls > 0).all()
    return {int(c): (float(w) if known else 1.0)
            for c, w in zip(df["call_id"], walls if known else [None] * len(df))}


def gather(rows: dict, w: World) -> dict | None:
    """Every rank's rows on rank 0 (None elsewhere)."""
    parts = [None] * w.size if w.rank == 0 else None
    dist.gather_object(rows, parts, dst=0)
    if w.rank != 0:
        return None
    merged: dict = {}
    for p in parts:
        merged.update(p)
    return merged


def barrier() -> None:

    dist.barrier()


def cpu_threads(w: World) -> int:
    """Intra-op threads per rank when ranks share one host's cores."""
    return max(1, (os.cpu_count() or 1) // max(int(os.environ.get("LOCAL_WORLD_SIZE", w.size)), 1))
