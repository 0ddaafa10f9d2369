"""The state digest capture stores and replay checks, whole vs sampled, side by side in one run.

    python benchmarks/bench_state_digest.py [SPEC ...]   (default: dlrm dlrm:large nanogpt;
                                                          --device cuda)

Builds each provider's model (CPU init, as capture and replay do; bf16), then times
``state_digest(model, sampled=False)`` (every byte, as runs stored before "v2:"),
``scheme="v2:"`` (tensors above 4 MiB as 256 blocks of 4 KiB) and ``state_digest(model)`` (what
capture stores now, "v3:": tensors above 64 KiB as 16 blocks of 4 KiB), best of 3 each,
interleaved, and prints the ratio of whole to sampled.
"""
import argparse
import time


def best(fn, n=3):
    out = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return min(out)


def main(argv=None):
    import torch

    from cbtrace.model.spec import resolve
    from cbtrace.state import state_digest

    ap = argparse.ArgumentParser()
    ap.add_argument("specs", nargs="*", default=["dlrm", "dlrm:large", "nanogpt"])
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args(argv)
    print(f"{'model':10} {'params MB':>10} {'whole s':>8} {'v2 s':>8} {'sampled s':>9} "
          f"{'ratio':>6}")
    for spec in a.specs:
        model, _ = resolve(spec, seed=0, options={}).model_and_batch(a.device, torch.bfloat16)
        mb = sum(t.numel() * t.element_size() for t in model.state_dict().values()) / 1e6
        whole = v2 = sampled = float("inf")
        for _ in range(3):  # interleaved: a neighbour's load hits all alike
            whole = min(whole, best(lambda: state_digest(model, sampled=False), 1))
            v2 = min(v2, best(lambda: state_digest(model, scheme="v2:"), 1))
            sampled = min(sampled, best(lambda: state_digest(model), 1))
        print(f"{spec:10} {mb:10.0f} {whole:8.3f} {v2:8.3f} {sampled:9.3f} {whole / sampled:5.0f}x")


if __name__ == "__main__":
    main()
