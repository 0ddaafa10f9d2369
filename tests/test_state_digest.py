"""The state digest a run stores (cbtrace.state.state_digest): replay knows a rebuilt model is
the one captured; tensors above 64 KiB are read as evenly spaced blocks, older runs' digests
(v2: above 4 MiB sampled; before it, whole) still verify."""
import pytest
import torch

from cbtrace.state import SAMPLED, SCHEMES, same_state, state_digest, state_fingerprint


class Table(torch.nn.Module):
    def __init__(self, rows: int, seed: int):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.emb = torch.nn.Parameter(torch.randn(rows, 256, generator=g))  # rows * 1 KiB
        self.fc = torch.nn.Linear(256, 8)


def test_small_models_are_digested_whole():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.LayerNorm(64))
    d = state_digest(m)
    assert d.startswith(SAMPLED) and d[len(SAMPLED):] == state_digest(m, sampled=False)
    assert same_state(m, d) and same_state(m, state_digest(m, sampled=False))  # old runs too
    with torch.no_grad():
        m[0].weight[3, 5] += 1
    assert not same_state(m, d)


def test_a_large_table_is_sampled_and_still_tells_models_apart():
    a, b = Table(80_000, seed=0), Table(80_000, seed=1)  # 78 MiB tables: sampled
    assert state_digest(a) != state_digest(b)
    assert same_state(a, state_digest(a)) and not same_state(b, state_digest(a))
    with torch.no_grad():
        a.emb[0, 0] += 1  # inside the first block
    assert not same_state(b, state_digest(a)) and state_digest(a) != state_digest(Table(80_000, 0))
    with torch.no_grad():
        a.emb[-1, -1] += 1  # inside the last block
    d = state_digest(a)
    assert same_state(a, d)
    # a full digest (older runs') reads every byte: the legacy verification still works
    assert same_state(a, state_digest(a, sampled=False))


def test_older_sampled_digests_still_verify():
    a, b = Table(3_000, seed=0), Table(3_000, seed=1)  # 2.9 MiB: whole under v2, sampled now
    v2 = state_digest(a, scheme="v2:")
    assert v2.startswith("v2:") and v2[3:] == state_digest(a, sampled=False)
    assert same_state(a, v2) and not same_state(b, v2)
    assert state_digest(a) != v2 and same_state(a, state_digest(a))


def test_tensors_above_the_threshold_are_read_in_blocks():
    above, blocks, block = SCHEMES[SAMPLED]
    t = Table(above // 1024 + 1, seed=0)  # one 1 KiB row over: sampled
    d = state_digest(t)
    n = t.emb.numel() * 4
    assert (n - block) // (blocks - 1) > block  # a gap after the first block
    with torch.no_grad():
        t.emb.view(-1)[block // 4] += 1  # the first float after the first block: not read
    assert same_state(t, d)
    with torch.no_grad():
        t.emb.view(-1)[0] += 1
    assert not same_state(t, d)


def test_fingerprint_reads_every_byte():
    t = Table(80_000, seed=0)
    before = state_fingerprint(t)
    with torch.no_grad():
        t.emb[40_000, 100] += 1  # between sampled blocks: replay's own checks must still see it
    assert state_fingerprint(t) != before


def test_replay_checks_the_rebuilt_model_against_the_stored_digest(tmp_path):
    import pytest
    from msgspec.structs import replace

    from cbtrace.capture.from_spec import capture_model
    from cbtrace.errors import ReplayError
    from cbtrace.replay.run_io.rebuild import rebuild_model
    from cbtrace.rundir.read import read_manifest

    capture_model("nanogpt:tiny", tmp_path / "r", device="cpu")
    m = read_manifest(tmp_path / "r")
    assert m.state_sha256.startswith(SAMPLED)
    model = rebuild_model(m, torch.device("cpu"), verify=True, run=tmp_path / "r")
    # a run of before the sampled digest stored the whole one: it verifies the same model
    old = replace(m, state_sha256=state_digest(model, sampled=False))
    rebuild_model(old, torch.device("cpu"), verify=True, run=tmp_path / "r")
    for bad in (SAMPLED + "0" * 64, "0" * 64):
        with pytest.raises(ReplayError, match="weights differ from the captured ones"):
            rebuild_model(replace(m, state_sha256=bad), torch.device("cpu"),
                          verify=True, run=tmp_path / "r")


def _mixed_model():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.BatchNorm1d(64),
                            torch.nn.Embedding(1000, 128), torch.nn.Linear(64, 8).bfloat16())
    m.register_buffer("strided", torch.randn(300, 400).t())  # not contiguous, sampled
    return m


@pytest.mark.gpu
def test_a_model_digests_alike_on_the_gpu_and_on_the_host():
    m = _mixed_model()
    want = [state_digest(m), state_digest(m, sampled=False), state_digest(m, scheme="v2:")]
    m.cuda()
    assert [state_digest(m), state_digest(m, sampled=False), state_digest(m, scheme="v2:")] == want
