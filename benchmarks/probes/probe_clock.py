"""Device probe: does do_bench's 100 ms loop pull the SM clock down on a heavy GEMM?

Times GPT-2's lm_head GEMM (bf16, 8192 x 768 -> 50304) with triton's do_bench at several
``rep`` lengths and with cbtrace's graph timer (default K and cold), reading the SM clock
(NVML, through torch.cuda.clock_rate) right after each. Run: python benchmarks/probes/probe_clock.py
"""
import torch


def clock():
    try:
        return torch.cuda.clock_rate()
    except Exception:  # noqa: BLE001 - NVML missing
        return float("nan")


def main():
    import time

    import triton.testing as tt

    from cbtrace.replay.timer.contract import TimingConfig
    from cbtrace.plugins.backends.graph import GraphTimer

    torch.manual_seed(0)
    lin = torch.nn.Linear(768, 50304, bias=False, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(8192, 768, device="cuda", dtype=torch.bfloat16)
    fn = lambda: lin(x)  # noqa: E731
    with torch.no_grad():
        fn()
        torch.cuda.synchronize()
        time.sleep(1.0)
        print(f"idle clock {clock()} MHz")
        print(f"{'method':<34}{'median ms':>10}{'SM MHz after':>14}")
        for rep in (5, 20, 100, 300):
            time.sleep(1.0)
            ms = tt.do_bench(fn, warmup=5, rep=rep, return_mode="median")
            print(f"{'do_bench rep=' + str(rep) + ' ms':<34}{ms:>10.4f}{clock():>14}")
        for name, cfg in (("cbtrace graph (default)", TimingConfig()),
                          ("cbtrace graph cold (K=1)", TimingConfig(graph_k=1))):
            time.sleep(1.0)
            t = GraphTimer().measure(lambda i: fn(), 1, torch.device("cuda"), cfg)
            print(f"{name + ' ' + (t.notes or ''):<34}{t.median_ms:>10.4f}{clock():>14}")


if __name__ == "__main__":
    main()
