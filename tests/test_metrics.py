"""Metric functions against figures worked out by hand."""
import pytest

from cbtrace.annotate.figures import colour
from cbtrace.cost import metrics as m
from cbtrace.plugins.reporters.palette import metric_color

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
    assert m.bound(1e9, 1e6, 0, H200_BF16, H200_BW) is None


def test_bound_roofline():
    # the GEMM above in 0.2 ms: compute needs 137.4e9/989.5e12 = 139 us, memory 100.7e6/4.8e12 = 21 us
    assert m.bound(2 * 4096 ** 3, 3 * 4096 ** 2 * 2, 0.2e-3, H200_BF16, H200_BW) == "compute"
    # an elementwise add of 2 x 64 MB -> 64 MB: 16.8M FLOPs (17 ns at peak) vs 201 MB (42 us)
    assert m.bound(16.8e6, 201e6, 50e-6, H200_BF16, H200_BW) == "memory"


def test_bound_launch():
    # 4 kernels in 18 us <= 4 * 5 us floor -> launch
    assert m.bound(1e9, 1e6, 18e-6, H200_BF16, H200_BW, kernel_count=4) == "launch"
    # same call at 30 us: 4 * 5 = 20 us < 30 us, so the roofline decides; 1e9/989.5e12 = 1 us of
    # compute vs 1e6/4.8e12 = 0.2 us of memory -> compute
    assert m.bound(1e9, 1e6, 30e-6, H200_BF16, H200_BW, kernel_count=4) == "compute"


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



def test_binding_utilisation():
    # a GEMM at 64 % MFU, 10 % MBU: compute binds
    assert m.binding_utilisation(0.64, 0.10, True, "compute") == ("mfu", 0.64)
    # a ReLU: no FLOPs, so MBU even though mfu reads 0
    assert m.binding_utilisation(0.0, 0.55, False) == ("mbu", 0.55)
    # an EmbeddingBag: 2 pooling FLOPs per gathered element give 0.1 % MFU next to 40 % MBU
    assert m.binding_utilisation(0.001, 0.40, True) == ("mbu", 0.40)
    # memory-bound says MBU even where the two shares compare the other way (other peaks)
    assert m.binding_utilisation(0.30, 0.20, True, "memory") == ("mbu", 0.20)
    # a missing MFU (no FLOP peak, e.g. fp64) falls back to MBU; nothing known -> no metric
    assert m.binding_utilisation(None, 0.3, True) == ("mbu", 0.3)
    assert m.binding_utilisation(float("nan"), None, True) == (None, None)
    assert m.binding_utilisation(0.2, None, False) == (None, None)


@pytest.mark.parametrize("mfu, mbu, flops, bound", [
    (0.64, 0.10, 1e9, "compute"), (0.0, 0.55, 0, None), (0.001, 0.40, 512, None),
    (0.30, 0.20, 1e6, "memory"), (None, 0.3, 1e6, None), (None, None, 0, None),
    (0.5, 0.5, 1e6, "launch"), (0.2, None, None, None),
])
def test_annotation_and_icicle_colour_by_the_same_metric(mfu, mbu, flops, bound):
    metric, _ = colour(mfu, mbu, flops, bound)
    _, label = metric_color(mfu, mbu, bool(flops), bound)
    assert metric == m.binding_utilisation(mfu, mbu, bool(flops), bound)[0]
    assert (label.split()[0].lower() if label else None) == metric
