"""Replay's rotating input copies made one by one against at once, side by side in one run.

For an embedding lookup (``embedding_copies``: ids shifted per copy, offsets copied) and dense
activations of two sizes (``copies_of``: only tensors up to ``STACK_MAX_BYTES`` are made at
once, larger ones are cloned one by one either way), each way of making the copies is run
``--repeats`` times: the host time per set of copies (median, ms; on CUDA with a synchronize
after each) and the ops that compute or copy (kernels on a GPU), counted under the profiler.
"One by one" is the loop the replay used before (a shift, a remainder and a clone per copy;
``clone_like`` per copy), "at once" what it uses now.

    python benchmarks/probes/probe_input_copies.py [--device cuda] [--repeats 50]
"""
import argparse
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

# metadata ops: no kernel, no copy
METADATA = {"aten::as_strided", "aten::select", "aten::unsqueeze", "aten::view", "aten::unbind",
            "aten::expand", "aten::reshape", "aten::alias", "aten::set_", "aten::empty",
            "aten::resize_", "aten::to", "aten::lift_fresh", "aten::detach", "aten::slice",
            "aten::result_type", "aten::empty_strided", "aten::_reshape_alias"}


def one_by_one_lookup(module, ids, offsets, n):
    """The copies as made before: per copy a shift, a remainder and a clone of the offsets."""
    from cbtrace.replay.measure.copies import clone_like

    rows = module.weight.shape[0]
    return [(((ids + (i * rows) // n) % rows).to(ids.dtype), clone_like(offsets))
            for i in range(1, n)]


def measure(fn, device, repeats: int) -> tuple[float, int]:
    """(median host ms of fn, ops of one run that compute or copy)."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(1e3 * (time.perf_counter() - t0))
    with profile(activities=[ProfilerActivity.CPU]) as p:
        fn()
    ops = sum(e.count for e in p.key_averages()
              if e.key.startswith("aten::") and e.key not in METADATA)
    return statistics.median(times), ops


def main() -> None:
    from cbtrace.replay.measure.copies import (clone_like, copies_of, embedding_copies,
                                               n_copies, tensor_bytes)

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--repeats", type=int, default=50)
    a = ap.parse_args()
    dev = torch.device(a.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    torch.manual_seed(0)
    bag = torch.nn.EmbeddingBag(20_000, 32, mode="sum").to(dev, dtype)  # a dlrm:large table
    ids = torch.randint(0, 20_000, (2048,), device=dev)
    offsets = torch.arange(2048, device=dev)
    n_bag = len(embedding_copies(bag, (ids, offsets), {}, dev))
    cases = [
        (f"lookup, {n_bag} copies", "one by one",
         lambda: one_by_one_lookup(bag, ids, offsets, n_bag)),
        (f"lookup, {n_bag} copies", "at once",
         lambda: embedding_copies(bag, (ids, offsets), {}, dev)),
    ]
    for rows in (64, 2048):  # a small Linear's input; a dlrm:large over-arch activation
        act = torch.randn(rows, 1024, device=dev, dtype=dtype)
        n = n_copies(tensor_bytes(act), dev, 8)
        what = f"{tensor_bytes(act) >> 10} KiB, {n} copies"
        cases += [(what, "one by one",
                   lambda act=act, n=n: [clone_like(((act,), {})) for _ in range(n - 1)]),
                  (what, "at once", lambda act=act, n=n: copies_of(((act,), {}), n - 1))]
    print(f"{dev.type}, {dtype}, median of {a.repeats}")
    print(f"{'inputs':<24} {'made':<11} {'host ms':>8} {'ops that compute or copy':>25}")
    for what, how, fn in cases:
        ms, ops = measure(fn, dev, a.repeats)
        print(f"{what:<24} {how:<11} {ms:>8.3f} {ops:>25}")


if __name__ == "__main__":
    main()
