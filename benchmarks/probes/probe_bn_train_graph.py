"""Device probe: why a train-mode BatchNorm2d reads 6-31 us a call more under the graph timer
than its kernels add up to (ResNet-50 train on an H100, session 21: layer2's BN 76 us timed,
48 us of kernels, 53 us in the step; eval-mode BN: timed = kernels + ~1 us).

For a BatchNorm2d in train mode (without and with autograd) and in eval mode (bf16, ResNet-50
layer2 shape), on rotating input
copies: K calls captured in one CUDA graph, replayed under the profiler; prints each kernel of
one replay with the gap before it, the replay's span per call, and CUDA events around a replay
per call. The kernels and gaps inside the graph say what the timer's figure holds that the step
does not.

Run: python benchmarks/probes/probe_bn_train_graph.py   (GPU)
"""
import torch

K, COPIES = 20, 4
SHAPE = (64, 128, 28, 28)  # ResNet-50 layer2 at batch 64


def graph_of(bn, xs):
    g, s = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for x in xs:  # warm-up on the side stream, as capture wants
            bn(x)
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g, stream=s):
        for j in range(K):
            bn(xs[j % len(xs)])
    return g


def replay_kernels(g):
    from torch.profiler import ProfilerActivity, profile

    g.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        g.replay()
        torch.cuda.synchronize()
    ev = sorted((e for e in prof.profiler.kineto_results.events()
                 if e.device_type() == torch.autograd.DeviceType.CUDA),
                key=lambda e: e.start_ns())
    return [(e.name(), e.start_ns(), e.duration_ns()) for e in ev]


def events_ms(g, n=20):
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ms = []
    for _ in range(n):
        torch.cuda.synchronize()
        s.record()
        g.replay()
        e.record()
        e.synchronize()
        ms.append(s.elapsed_time(e))
    return sorted(ms)[n // 2]


def main():
    torch.manual_seed(0)
    xs = [torch.randn(SHAPE, device="cuda", dtype=torch.bfloat16) for _ in range(COPIES)]
    # "train, grad": as a train step's replay runs it (its input an activation needing grad)
    for mode in ("train", "train, grad", "eval"):
        bn = torch.nn.BatchNorm2d(SHAPE[1]).to("cuda", torch.bfloat16)
        bn.train(mode != "eval")
        grad = mode == "train, grad"
        inputs = [x.detach().requires_grad_(grad) for x in xs]
        with torch.set_grad_enabled(grad):
            g = graph_of(bn, inputs)
            ks = replay_kernels(g)
            per_call = events_ms(g) / K
        busy = sum(d for _, _, d in ks) / 1e3 / K
        span = (ks[-1][1] + ks[-1][2] - ks[0][1]) / 1e3 / K if ks else float("nan")
        print(f"\n== BatchNorm2d {mode} {SHAPE} bf16, K={K}: events {per_call * 1e3:.1f} us a "
              f"call; kernels busy {busy:.1f} us, span {span:.1f} us a call; "
              f"{len(ks) / K:.1f} kernels a call")
        prev_end = None
        for name, start, dur in ks[:3 * max(1, len(ks) // K)]:  # the first three calls
            gap = (start - prev_end) / 1e3 if prev_end is not None else 0.0
            print(f"   gap {gap:6.1f} us  {dur / 1e3:6.1f} us  {name[:100]}")
            prev_end = start + dur


if __name__ == "__main__":
    main()
