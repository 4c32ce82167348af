"""Claims of lessons 07 and 09 that rest on picolib's builders and hardware model, checked
without running the notebooks: DualPipe(V)'s micro-batch and rank requirements, and the MoE
critical batch computed two ways (switch-level model against one GPU's own NIC)."""
import pytest

from picolib.hardware import (GPUS, Hardware, Level, all_reduce_bandwidth, critical_tokens_dp,
                              critical_tokens_moe)
from picolib.pipeline_schedules import make_schedule


@pytest.mark.parametrize("p", range(2, 9))
def test_dualpipe_and_dualpipev_need_2p_micro_batches(p):
    for m in range(1, 3 * p):
        for name in ("dualpipev", "dualpipe"):
            odd = name == "dualpipe" and (p % 2 or m % 2)
            if m >= 2 * p and not odd:
                make_schedule(name, p, m)
            else:
                with pytest.raises(ValueError, match="even p" if odd else "m ≥ 2p"):
                    make_schedule(name, p, m)


def test_400_gb_s_is_a_node_of_eight_nics():
    h100, nic = GPUS["H100-SXM"], 400e9 / 8
    assert h100.levels[1].per_gpu == nic
    assert all_reduce_bandwidth(h100, 256) == 8 * nic
    assert round(critical_tokens_dp(h100, 256)) == 1236            # the published figure


def test_moe_critical_batch_two_ways():
    h100 = GPUS["H100-SXM"]
    levels = critical_tokens_moe(h100, 32, 256, 8, ep=64)
    own_nic = (256 / 64) / 8 * h100.bf16 / (2 * 50e9)
    assert levels == pytest.approx(own_nic, rel=1e-12)
    assert abs(levels - 4944) < 2                                  # the published 1236·256/8/8
    h800 = Hardware("H800", 989e12, 1979e12, 80e9, 3.35e12,
                    (Level("node", 8, 160e9, 8 * 160e9), Level("IB", 2048, 50e9, 2048 * 50e9)))
    v3 = critical_tokens_moe(h800, 2, 256, 8, ep=64)               # 2 copies per 128-GPU stage
    assert v3 == pytest.approx(own_nic, rel=1e-12)                 # the IB NIC sets it, not NVLink
    assert 15_360 * 4_096 / (2048 // 16) > 90 * v3
