"""How long the built-in providers take to build their models on this CPU: PyTorch's default
init (how they built before: a module's own init, then nanoGPT's on top) against
``plugins/providers/weights.py`` (no default init; each parameter chunk from its own CPU
generator, on a thread pool of torch.get_num_threads() threads). Float32, as the providers build
on the CPU before any move or cast. Alternating, REPEATS of each; wall and process CPU seconds.

    python benchmarks/probes/bench_provider_build.py [SPEC ...]     (default: nanogpt dlrm dlrm:large)
"""
import gc
import sys
import time

import torch

SPECS = ["nanogpt", "dlrm", "dlrm:large"]
REPEATS = 2


def default_init(provider):
    """The model as the providers built it before: its modules' own init (GPT adds nanoGPT's)."""
    from cbtrace.plugins.providers.dlrm import DLRMProvider, SimpleDeepFMNN
    from cbtrace.plugins.providers.nanogpt import GPT

    torch.manual_seed(provider.seed)
    if isinstance(provider, DLRMProvider):
        return SimpleDeepFMNN(provider.config())
    return GPT(provider._preset()["config"])


def timed(fn):
    gc.collect()
    t, c = time.perf_counter(), time.process_time()
    model = fn()
    wall, cpu = time.perf_counter() - t, time.process_time() - c
    n = sum(p.numel() for p in model.parameters())
    del model
    return wall, cpu, n


def main(specs):
    from cbtrace.model.spec import resolve

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for spec in specs:
        provider = resolve(spec)
        runs = {"default init": [], "weights.py": []}
        for _ in range(REPEATS):
            runs["default init"].append(timed(lambda: default_init(provider)))
            runs["weights.py"].append(timed(lambda: provider.build_model("cpu")))
        for how, rs in runs.items():
            walls = ", ".join(f"{w:.2f}" for w, _, _ in rs)
            cpus = ", ".join(f"{c:.2f}" for _, c, _ in rs)
            print(f"{spec:12s} {rs[0][2] / 1e6:6.1f} M params  {how:12s}  wall {walls} s  "
                  f"cpu {cpus} s", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or SPECS)
