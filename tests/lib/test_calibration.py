"""bench/gpu_calibrate.py measures the planner's fractions where it runs (here: this CPU, small
sizes, two gloo processes) and `picolib.hardware.calibrated` makes them a preset the planner
prices with. A GPU session runs the same script on the Hopper preset."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from picolib.hardware import CPU_MEASURED, PRESETS, calibrated
from picolib.model import LlamaConfig
from picolib.plan_search import step_time
from picolib.planner import Parallelism

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("gpu_calibrate", ROOT / "bench" / "gpu_calibrate.py")
gpu_calibrate = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_calibrate)


@pytest.fixture(scope="module")
def measured():
    return gpu_calibrate.calibrate("CPU", "cpu", small=True, reps=3)


def test_every_term_is_measured(measured):
    terms = measured["terms"]
    assert set(terms) == {"matmul_eff", "hbm_eff", "attention_eff", "launch", "link_eff"}
    assert len(measured["matmuls"]) == len(gpu_calibrate.matmul_shapes(True))
    sizes = [r["bytes"] for r in measured["all_reduce"]["sizes"]]
    assert measured["all_reduce"]["ranks"] == 2 and sizes == sorted(sizes) and sizes[0] == 1024
    # the copy against bench/cpu_roofline.py's figure for this machine (a loaded machine only
    # slows a run down, and the two scripts differ in size: within a factor of 10)
    assert CPU_MEASURED["bandwidth"] / 10 < measured["copy_bytes_per_s"] < CPU_MEASURED["bandwidth"] * 3
    assert 0 < terms["launch"] < 1e-3
    # a small all-reduce is latency-bound: its bus bandwidth is below the largest one's
    rows = measured["all_reduce"]["sizes"]
    assert rows[0]["busbw"] < rows[-1]["busbw"]


def test_a_calibrated_preset_prices_with_the_measured_fractions(measured, tmp_path):
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps(measured))
    hw = calibrated("CPU", path)
    assert hw.matmul_eff == max(r["eff"] for r in measured["matmuls"])
    assert (hw.bf16, hw.hbm_bandwidth, hw.levels) == (PRESETS["CPU"].bf16, PRESETS["CPU"].hbm_bandwidth, PRESETS["CPU"].levels)
    # halving the matmul fraction makes a compute-bound step slower, by less than 2× (not all is matmul)
    cfg = LlamaConfig(vocab_size=512, hidden=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_hidden=768)
    par = Parallelism(seq=256, micro_batches=2, precision="fp32")
    slow = calibrated("CPU", {**measured, "terms": {**measured["terms"], "matmul_eff": hw.matmul_eff / 2}})
    t, t_slow = step_time(cfg, par, hw)["seconds"], step_time(cfg, par, slow)["seconds"]
    assert t < t_slow < 2 * t


def test_unknown_terms_and_bad_arguments_are_refused(capsys):
    with pytest.raises(ValueError, match="not fractions"):
        calibrated("CPU", {"terms": {"matmul_eff": 0.5, "peak": 1.0}})
    with pytest.raises(SystemExit) as e:
        gpu_calibrate.main(["--base", "H900"])
    assert e.value.code == 2 and "unknown hardware 'H900'" in capsys.readouterr().err
