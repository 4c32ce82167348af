"""Lesson 05's try-it: `saved_bytes` equals what tensor-parallel ranks measurably save
(picolib.memory.SavedActivations), with and without SP; every knob combination runs."""
import itertools

import matplotlib
import pytest

from picolib.launch import run
from picolib.memory import SavedActivations
from picolib.model import LlamaConfig, TinyLlama, random_tokens
from picolib.tensor_parallel import apply_tensor_parallel
from picolib.tryit.lesson05 import saved_bytes, saved_bytes_bars

matplotlib.use("Agg")

CFG = LlamaConfig(vocab_size=64, hidden=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_hidden=64)


def _saved_by_block(sp, tokens, targets):
    model = apply_tensor_parallel(TinyLlama(CFG), sequence_parallel=sp)
    with SavedActivations(model) as act:
        model.loss(tokens, targets)
    return sum(v for k, v in act.by_module.items() if k.startswith("blocks.0."))


@pytest.mark.parametrize("tp, seq, sp", [(1, 16, False), (2, 16, False), (2, 16, True),
                                         (4, 24, False), (4, 24, True)])
def test_saved_bytes_equal_the_measured_bytes(tp, seq, sp):
    tokens, targets = random_tokens(2, seq, CFG.vocab_size, seed=3)
    measured = run(_saved_by_block, tp, sp, tokens, targets)
    expected = saved_bytes(tp, seq, sp, hidden=CFG.hidden, ffn_hidden=CFG.ffn_hidden,
                           n_heads=CFG.n_heads, batch=2)
    assert measured == [expected] * tp


def test_sp_saves_less_from_tp_2_on():
    for seq in (128, 4096):
        assert saved_bytes(1, seq, True) == saved_bytes(1, seq, False)
        for tp in (2, 4, 8):
            assert saved_bytes(tp, seq, True) < saved_bytes(tp, seq, False)


def test_every_knob_combination_runs(monkeypatch):
    import matplotlib.pyplot as plt
    monkeypatch.setattr(plt, "show", lambda: None)
    for tp, seq, sp in itertools.product([1, 2, 4, 8], range(128, 4097, 128 * 7), [False, True]):
        out = saved_bytes_bars(tp, seq, sp)
        assert 0 < out["fraction"] <= 1
        plt.close("all")
    with pytest.raises(ValueError, match="multiple of 8"):
        saved_bytes_bars(2, 100, True)
