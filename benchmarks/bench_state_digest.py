"""The state digest capture stores and replay checks, whole vs sampled, side by side in one run.

    python benchmarks/bench_state_digest.py [SPEC ...]   (default: dlrm dlrm:large nanogpt;
                                                          --device cuda)

Builds each provider's model (CPU init, as capture and replay do; bf16), then times
``state_digest(model, sampled=False)`` (every byte, as runs stored before "v2:"),
``scheme="v2:"`` (tensors above 4 MiB as 256 blocks of 4 KiB) and ``state_digest(model)`` (what
capture stores now, "v3:": tensors above 64 KiB as 16 blocks of 4 KiB), best of 3 each,
interleaved, and prints the ratio of whole to sampled. On a GPU also ``per tensor``: the sampled
digest as it was read before session 10, each tensor's blocks gathered and copied to the host
on their own (one sync each), against ``state_digest``'s one copy per device; the two digests
must be equal.
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


def per_tensor_digest(model) -> str:
    """The sampled digest as read before session 10: one device-to-host copy per tensor."""
    import hashlib

    from cbtrace import module_tree
    from cbtrace.state import SAMPLED, SCHEMES, _device_sample, _digest_blocks

    how = SCHEMES[SAMPLED]
    h = hashlib.sha256()
    model = module_tree.unwrap(model)
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        h.update(f"{module_tree.user_name(name)}:{t.dtype}:{tuple(t.shape)}".encode())
        if t.numel():
            t = t.detach()
            blocks = ([_device_sample(t, how).cpu().numpy()] if t.device.type != "cpu"
                      else _digest_blocks(t, how))
            for block in blocks:
                h.update(block)
    return SAMPLED + h.hexdigest()


def main(argv=None):
    import torch

    from cbtrace.model.spec import resolve
    from cbtrace.state import state_digest

    ap = argparse.ArgumentParser()
    ap.add_argument("specs", nargs="*", default=["dlrm", "dlrm:large", "nanogpt"])
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args(argv)
    gpu = a.device.startswith("cuda")
    print(f"{'model':10} {'params MB':>10} {'whole s':>8} {'v2 s':>8} {'sampled s':>9} "
          f"{'ratio':>6}" + (f" {'per tensor s':>12} {'ratio':>6}" if gpu else ""))
    for spec in a.specs:
        model, _ = resolve(spec, seed=0, options={}).model_and_batch(a.device, torch.bfloat16)
        mb = sum(t.numel() * t.element_size() for t in model.state_dict().values()) / 1e6
        whole = v2 = sampled = per = float("inf")
        for _ in range(3):  # interleaved: a neighbour's load hits all alike
            whole = min(whole, best(lambda: state_digest(model, sampled=False), 1))
            v2 = min(v2, best(lambda: state_digest(model, scheme="v2:"), 1))
            sampled = min(sampled, best(lambda: state_digest(model), 1))
            if gpu:
                per = min(per, best(lambda: per_tensor_digest(model), 1))
        line = f"{spec:10} {mb:10.0f} {whole:8.3f} {v2:8.3f} {sampled:9.3f} {whole / sampled:5.0f}x"
        if gpu:
            assert per_tensor_digest(model) == state_digest(model), spec
            line += f" {per:12.3f} {per / sampled:5.1f}x"
        print(line)


if __name__ == "__main__":
    main()
