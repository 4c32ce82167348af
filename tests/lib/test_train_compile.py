"""`--compile` (issue 49.3): torch.compile of each transformer block, off by default. On the
layouts it serves, the compiled run's loss curve equals the eager one within 1e-5 (fp32;
Inductor may fuse and reorder a block's arithmetic — on this CPU the curves came out
bit-identical); on the layouts whose blocks it cannot compile (tensor or context parallelism,
experts, ZeRO-3) the command line refuses it before any rank starts, saying why.
Each compiled run costs about a minute of Inductor compilation on 2 cores: two layouts only."""
import dataclasses

import pytest

from picolib.launch import run
from picolib.train import TrainConfig, main, train


def _eager_then_compiled(cfg):
    return [[r["loss"] for r in train(dataclasses.replace(cfg, compile=c))] for c in (False, True)]


@pytest.mark.parametrize("nproc, options", [(1, dict(micro_batches=2)),
                                            (4, dict(dp=2, pp=2, zero=1, micro_batches=2))],
                         ids=["one process", "dp2×pp2 ZeRO-1 1F1B"])
def test_compiled_blocks_train_as_eager_ones(nproc, options):
    cfg = TrainConfig(steps=3, progress=False, **options)
    eager, compiled = run(_eager_then_compiled, nproc, cfg, timeout=600)[0]
    assert max(abs(a - b) for a, b in zip(eager, compiled, strict=True)) <= 1e-5, (eager, compiled)
    assert compiled[-1] < compiled[0]


@pytest.mark.parametrize("argv, flag", [
    (["--tp", "2"], "--tp"), (["--dp", "2", "--cp", "2"], "--cp"),
    (["--experts", "4"], "--experts"), (["--dp", "2", "--zero", "3"], "--zero 3")])
def test_compile_is_refused_where_blocks_cannot_compile(argv, flag, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--compile", "--steps", "1", "--no-progress"] + argv)
    assert e.value.code == 2
    assert f"error: --compile does not work with {flag}:" in capsys.readouterr().err
