"""The trainer refuses a pipeline whose stages would hold different numbers of layers
(picolib.pipeline_parallel.partition cuts equal stages only) before any rank starts: an
argparse error naming the numbers, exit 2."""
import pytest

from picolib import train
from picolib.compose import TrainConfig, check_config


@pytest.mark.parametrize("argv, says", [
    (["--pp", "3", "--micro-batches", "3", "--batch", "3"],            # tiny: 4 layers
     "4 layers do not split evenly into 3 stages (--pp 3)"),
    (["--preset", "small", "--pp", "2", "--schedule", "interleaved", "--chunks", "3",
      "--micro-batches", "2", "--batch", "2"],                         # small: 8 layers, 6 stages
     "8 layers do not split evenly into 6 stages (--pp 2 × --chunks 3)"),
])
def test_uneven_stages_refused_before_any_rank(argv, says, capsys):
    with pytest.raises(SystemExit) as e:
        train.main(["--nproc", str(int(argv[argv.index("--pp") + 1])), "--steps", "1", *argv])
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert f"python -m picolib.train: error: {says}" in err


def test_even_stages_pass():
    check_config(TrainConfig(pp=2, micro_batches=2, batch=2), 2)                 # 4 layers, 2 stages
    check_config(TrainConfig(preset="small", pp=2, schedule="interleaved", chunks=2,
                             micro_batches=2, batch=2), 2)                       # 8 layers, 4 stages
