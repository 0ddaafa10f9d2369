"""Metric functions against figures worked out by hand."""
import pytest

from cbtrace.cost import metrics as m

H200_BF16, H200_BW = 989.5e12, 4.8e12


def test_mfu_hfu_mbu():
    # lm_head GEMM 8192x768 @ 768x50304: 2*8192*768*50304 = 632.97 GFLOP in 1 ms
    # -> 632.97e12 FLOP/s / 989.5e12 = 0.63969
    flops = 2 * 8192 * 768 * 50304
    assert flops == 632_970_805_248
    assert m.mfu(flops, 1e-3, H200_BF16) == pytest.approx(0.639688, rel=1e-5)
    # causal attention executes ~half: hfu = 0.5 * mfu
    assert m.hfu(flops / 2, 1e-3, H200_BF16) == pytest.approx(0.319844, rel=1e-5)
    # 2.4 GB moved in 1 ms = 2.4 TB/s of 4.8 -> 0.5
    assert m.mbu(2.4e9, 1e-3, H200_BW) == pytest.approx(0.5)


def test_missing_or_meaningless_inputs_give_none():
    assert m.mfu(None, 1e-3, H200_BF16) is None
    assert m.mfu(1e9, 0.0, H200_BF16) is None
    assert m.mbu(1e9, 1e-3, None) is None
    assert m.arithmetic_intensity(1e9, 0) is None
    assert m.bound(1e9, 1e6, 0, H200_BF16, H200_BW) is None


def test_arithmetic_intensity_and_ridge_point():
    # bf16 mm 4096^3: 2*4096^3 = 137.4 GFLOP over 3 * 4096^2 * 2 B = 100.7 MB -> 1365.33 FLOP/B
    flops, nbytes = 2 * 4096 ** 3, 3 * 4096 ** 2 * 2
    assert m.arithmetic_intensity(flops, nbytes) == pytest.approx(4096 / 3)
    # H200: 989.5e12 / 4.8e12 = 206.15 FLOP/B
    assert m.ridge_point(H200_BF16, H200_BW) == pytest.approx(206.145833, rel=1e-6)


def test_bound_roofline():
    # the GEMM above in 0.2 ms: compute needs 137.4e9/989.5e12 = 139 us, memory 100.7e6/4.8e12 = 21 us
    assert m.bound(2 * 4096 ** 3, 3 * 4096 ** 2 * 2, 0.2e-3, H200_BF16, H200_BW) == "compute"
    # an elementwise add of 2 x 64 MB -> 64 MB: 16.8M FLOPs (17 ns at peak) vs 201 MB (42 us)
    assert m.bound(16.8e6, 201e6, 50e-6, H200_BF16, H200_BW) == "memory"


def test_bound_launch():
    # wall 20 us, device busy 8 us: launch overhead 12 us >= half -> launch
    assert m.bound(1e9, 1e6, 20e-6, H200_BF16, H200_BW, launch_overhead_s=12e-6, kernel_count=1) == "launch"
    # 4 kernels in 18 us <= 4 * 5 us floor -> launch, even with no measured overhead
    assert m.bound(1e9, 1e6, 18e-6, H200_BF16, H200_BW, launch_overhead_s=0.0, kernel_count=4) == "launch"
    # same call at 30 us: 4 * 5 = 20 us < 30 us, so the roofline decides; 1e9/989.5e12 = 1 us of
    # compute vs 1e6/4.8e12 = 0.2 us of memory -> compute
    assert m.bound(1e9, 1e6, 30e-6, H200_BF16, H200_BW, launch_overhead_s=0.0, kernel_count=4) == "compute"


def test_bound_with_one_peak_missing():
    # CPU without a calibrated bandwidth: 2e9 FLOPs at 100 GFLOP/s need 20 ms of a 25 ms call
    assert m.bound(2e9, 1e6, 25e-3, 100e9, None) == "compute"
    # ... but of a 100 ms call they explain only 20%: undecided
    assert m.bound(2e9, 1e6, 100e-3, 100e9, None) is None


def test_residual():
    # NanoGPT: a Block at 0.61 ms with ln_1 0.02, attn 0.25, ln_2 0.02, mlp 0.28 -> 0.04 ms of glue
    assert m.residual(0.61, [0.02, 0.25, 0.02, 0.28]) == pytest.approx(0.04)
    assert m.residual(0.61, []) == 0.61
    assert m.residual(0.61, [0.2, None]) is None
    assert m.residual(None, [0.2]) is None


def test_achieved_rate():
    # 632.97 GFLOP in 0.8 ms = 791.21 TFLOP/s (close to the 788 calibrated on the H200)
    assert m.achieved_per_s(632_970_805_248, 0.8e-3) == pytest.approx(791.2135e12, rel=1e-6)
