"""Issue 30's ladder (opt-in: pytest -m benchmark tests/benchmarks): how a whole simulate's wall time grows from
128 to 1,024 GPUs, the 16,384-GPU rung against issue 30's target, and a folded rung equal to its unfolded run."""

import json

import pytest

from pipescope.experiments.bench_scale import LADDER, TARGET, _child, case_args, exponent, run_case


@pytest.mark.benchmark
def test_the_ladder_to_1024_gpus_grows_at_most_quadratically() -> None:
    """Measured 2026-11-28 on a 2-core machine: 0.7, 5.3 and 27.8 s for 128, 256 and 1,024 GPUs (README, "Speed")."""
    rows = [run_case(w) for w in LADDER[:3]]
    assert rows[-1]["wall_s"] <= 90 and rows[-1]["peak_rss_bytes"] <= 2 * 2**30
    assert exponent(rows) <= 2.0


@pytest.mark.benchmark
def test_one_all_reduce_over_32768_gpus_takes_seconds() -> None:
    """Issue 30's second row: ``pipescope collective`` over 4,096 dgx-h100 servers in at most 10 s, start included.
    Measured on a 2-core machine (README, "Speed"): see the note there; routes are searched once per class of
    server pair (simulator/server_symmetry.py)."""
    from pipescope.experiments.bench_scale import run_collective
    rung = run_collective(4096)
    assert rung["gpus"] == 32_768 and rung["wall_s"] <= 10.0 and rung["peak_rss_bytes"] <= 2 * 2**30


@pytest.mark.benchmark
def test_16384_gpus_in_30_seconds_and_2_gib() -> None:
    """Issue 30's first row, folded (simulator/fold.py): measured 23.8 s and 1.47 GiB on a 2-core machine, where
    every replica took 550 s and 2.81 GiB, the same --json (README, "Speed")."""
    rung = run_case(LADDER[-1])
    assert rung["gpus"] == TARGET["gpus"] and rung["replayed"] < rung["data_parallel"]
    assert rung["wall_s"] <= TARGET["wall_s"] and rung["peak_rss_bytes"] <= TARGET["peak_rss_bytes"]


@pytest.mark.benchmark
def test_the_folded_1024_gpu_rung_is_the_unfolded_one() -> None:
    """The --json of the 1,024-GPU rung with cluster.fold true and false, whole, but for the replay's own counters."""
    outputs = []
    for fold in ("true", "false"):
        _, _, result = _child(case_args(8) + ["--set", f"cluster.fold={fold}"], f"fold {fold}")
        result.pop("sim_wall_s")
        for key in ("flows", "rate_updates", "folding"):
            result["network"].pop(key)
        outputs.append(json.dumps(result, sort_keys=True))
    assert outputs[0] == outputs[1]
