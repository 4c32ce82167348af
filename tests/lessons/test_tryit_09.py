"""Lesson 09's try-it: `dispatch_bytes` equals the bytes a Ledger counts on real EP ranks
(evenly routed tokens, both dispatchers); every knob combination runs."""
import matplotlib
import pytest
import torch
import torch.distributed as dist

from picolib.comm import Ledger
from picolib.expert_parallel import ExpertParallelMoE
from picolib.launch import run
from picolib.moe import MoE
from picolib.tryit.lesson09 import dispatch_bytes, dispatch_bytes_bars

matplotlib.use("Agg")
H, E, T = 16, 8, 16


def _even_tokens():
    """Token t prefers experts t, t+1, t+2 (mod E), in that order: every expert gets the
    same number of assignments from every rank at every k."""
    x = torch.zeros(T, H)
    for t in range(T):
        for j, w in enumerate((1.0, 0.5, 0.25)):
            x[t, (t + j) % E] = w
    return x


def _measure(k, dispatcher):
    layer = ExpertParallelMoE(MoE(H, E, k, 8, seed=0), None, dispatcher)
    with torch.no_grad():
        layer.router.weight.copy_(10 * torch.eye(E, H))
    x = _even_tokens()
    expected = layer.route(x).choice
    with Ledger() as led:
        layer(x)
    assert torch.equal(expected[:, 0], torch.arange(T) % E)
    return led.total("sent_bytes")


@pytest.mark.parametrize("ep", [2, 4])
def test_dispatch_bytes_equal_the_ledger(ep):
    def worker():
        return {(k, d): _measure(k, d) for k in (1, 2, 3) for d in ("alltoall", "allgather")}
    for measured in run(worker, ep, timeout=60):
        for (k, d), sent in measured.items():
            assert sent == dispatch_bytes(ep, k, d, tokens=T, hidden=H, n_experts=E,
                                          bytes_per_element=4), (ep, k, d, sent)


def test_all_to_all_grows_linearly_in_k_and_all_gather_barely():
    a2a = [dispatch_bytes(8, k) for k in range(1, 9)]
    counts = dispatch_bytes(8, 1) - 2 * 4096 * 7 // 8 * 4096 * 2
    assert all(abs((a - counts) / (a2a[0] - counts) - k) < 1e-9 for k, a in enumerate(a2a, 1))
    ag = [dispatch_bytes(8, k, "allgather") for k in range(1, 9)]
    assert ag[-1] / ag[0] < 1.01


def test_every_knob_combination_runs(monkeypatch):
    import matplotlib.pyplot as plt
    monkeypatch.setattr(plt, "show", lambda: None)
    for ep in (2, 4, 8, 16, 64):
        for k in range(1, 9):
            out = dispatch_bytes_bars(ep, k)
            assert out["alltoall"] > 0 and out["allgather"] > 0
            plt.close("all")
    with pytest.raises(ValueError, match="top_k must be one of"):
        dispatch_bytes_bars(8, 9)


def test_each_suggestion_in_the_hint_shows_what_it_says(monkeypatch, capsys):
    """The lesson's try-it cell lists four things to try; each one, run through the knob
    function as the learner would, shows what the hint says."""
    import matplotlib.pyplot as plt
    monkeypatch.setattr(plt, "show", lambda: None)

    def bars(ep, k):
        out = dispatch_bytes_bars(ep, k)
        plt.close("all")
        return out
    # ep = 8, top-1 → top-2: the all-to-all doubles, the all-gather moves < 0.1 %
    one, two = bars(8, 1), bars(8, 2)
    assert two["alltoall"] / one["alltoall"] == pytest.approx(2, rel=1e-4)
    assert 1 < two["allgather"] / one["allgather"] < 1.001
    # ep = 16 → 64: all-to-all +5 % (saturates), all-gather ×4.2
    a, b = bars(16, 1), bars(64, 1)
    assert b["alltoall"] / a["alltoall"] == pytest.approx(1.05, abs=0.005)
    assert b["allgather"] / a["allgather"] == pytest.approx(4.2, abs=0.005)
    # ep = 2, top-1…4: the printed ratio ≈ ep/k (2, 1, 0.67, 0.5); all-gather smaller once k > ep
    capsys.readouterr()
    for k, printed in zip(range(1, 5), ("2.00", "1.00", "0.67", "0.50")):
        r = bars(2, k)
        assert f"all-gather / all-to-all = {printed}" in capsys.readouterr().out
        assert (r["ratio"] < 1) == (k > 2)
    # ep = 64, top-8 (DeepSeek-V3's): about 8×
    assert bars(64, 8)["ratio"] == pytest.approx(8, rel=0.01)
