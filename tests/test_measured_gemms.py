"""Measured GEMM rates (``pipescope calibrate-gemms`` and ``costs.gemms``, docs/costs.md "Measured GEMMs"): the sweep
times real torch matmuls, the table prices the analytic model's matmuls, and a bad table is one line naming the
key."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

import pipescope
from pipescope.experiments.cli import main
from pipescope.simulator.gpu_rates import Tiling
from pipescope.simulator.kernels import Gemm
from pipescope.simulator.measured_gemms import MeasuredGemms, load_gemms
from pipescope.simulator.readers.profile_schema import SCHEMA_VERSION
from pipescope.topologies.devices import DEVICES

H100 = DEVICES["h100"]


def write_table(folder: Path, rows: list[tuple[int, int, int, float]], precision: str = "bf16",
                device: str = "NVIDIA H100 80GB HBM3", header: str = "m,n,k,median_ns") -> Path:
    """A gemms folder as calibrate-gemms writes it (CSV), rows of (m, n, k, median ns)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "gemms.csv").write_text(header + "\n" + "".join(f"{m},{n},{k},{ns}\n" for m, n, k, ns in rows))
    (folder / "gemms.json").write_text(json.dumps({
        "schema_version": SCHEMA_VERSION, "kind": "gemms", "precision": precision,
        "device": {"type": "cuda", "name": device}, "tables": {"gemms": "gemms.csv"}}))
    return folder


def ns_at(rate: float, m: int, n: int, k: int) -> float:
    return 2 * m * n * k / rate * 1e9


def test_calibrate_gemms_times_every_shape_with_torch(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "gemms"
    assert main(["calibrate-gemms", "--sizes", "32,64", "--device", "cpu", "--out", str(out), "--budget-s",
                 "0.02", "--min-reps", "3"]) == 0
    gemms = load_gemms(out, "fp32")
    assert sorted(point[:3] for point in gemms.points) == sorted(itertools.product((32, 64), repeat=3))
    assert all(rate > 1e6 for *_, rate in gemms.points)  # a real CPU matmul: over a MFLOP/s, not a placeholder
    assert gemms.meta["device"]["type"] == "cpu" and "8/8 64 x 64 x 64" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--sizes", "64,0"], "--sizes: got 0, expected comma-separated positive integers"),
    (["--sizes", "1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17"], "--sizes: got 17 sizes (4913 shapes), expected at "
                                                               "most 16 sizes"),
    (["--sizes", "65536", "--device", "cpu"], "--sizes: got 65536, expected sizes whose largest matmul fits"),
    (["--precision", "fp8"], "--precision: got 'fp8', expected one of bf16, fp16, fp32"),
    ([], "--out: missing"),
])
def test_calibrate_gemms_refuses_bad_flags_in_one_line(argv: list[str], message: str, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture) -> None:
    out = [] if not argv or argv[0] == "--out" or message.startswith("--out") else ["--out", str(tmp_path / "o")]
    assert main(["calibrate-gemms", *argv, *out]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"pipescope: error: {message}") and err.count("\n") == 1, err


def test_a_measured_shape_runs_at_its_rate_and_others_at_the_nearest_scaled_by_tiling() -> None:
    tiling = Tiling(H100.sms)
    gemms = MeasuredGemms(((4096, 4096, 4096, 700e12), (1024, 1024, 1024, 300e12)))
    assert gemms.flop_rate(Gemm(1, 4096, 4096, 4096), tiling) == pytest.approx(700e12)
    assert gemms.flop_rate(Gemm(1, 1024, 1024, 1024), tiling) == pytest.approx(300e12)
    query = Gemm(1, 2048, 6144, 4096)  # nearer 4096^3 than 1024^3 on log2 axes
    expected = 700e12 * tiling.efficiency(1, 2048, 6144, 4096) / tiling.efficiency(1, 4096, 4096, 4096)
    assert gemms.flop_rate(query, tiling) == pytest.approx(expected)
    assert gemms.flop_rate(query, None) == 700e12  # without tiling: the nearest shape's rate as it is
    small = MeasuredGemms(((512, 512, 512, 300e12),))  # 16 of 132 SMs busy: the tiling ratio alone would be 20x
    assert small.flop_rate(Gemm(1, 1024, 1024, 512), tiling) == 300e12  # never above the fastest measured


def test_a_table_of_the_published_benchmark_reproduces_the_default_model(tmp_path: Path) -> None:
    """H100's default rate is anchored at its benchmark's one shape (docs/costs.md, "Rates"); a table holding only
    that measurement must price every matmul as the default does, up to the rate it measured, and a faster table
    must run the demo faster."""
    from pipescope.runner import prepare
    from pipescope.simulator.kernels import layer_kernels, output_kernels
    from pipescope.simulator.models import allocated_vocab

    shape, rate = H100.gemm_shape, H100.gemm_measured * 989e12
    folder = write_table(tmp_path / "bench", [(*shape, ns_at(rate, *shape))])
    default = prepare(pipescope.load_config("demo")).costs
    measured = prepare(pipescope.load_config("demo", [f"costs.gemms={folder}"])).costs
    padded = allocated_vocab("megatron", default.model.vocab)  # the demo's runtime pads its vocabulary
    kernels = [k for k in layer_kernels(default.model, 4, "bf16")
               + output_kernels(default.model, 4, "bf16", allocated=padded) if k.gemm is not None]
    assert len(kernels) >= 8
    for kernel in kernels:
        expected = min(default.roofline.flop_rate(kernel), rate * H100.sustained)  # both under continuous load
        assert measured.roofline.flop_rate(kernel) == pytest.approx(expected, rel=1e-12), kernel.name
    faster = write_table(tmp_path / "fast", [(*shape, ns_at(950e12, *shape))])
    assert pipescope.run(pipescope.load_config("demo", [f"costs.gemms={faster}"])).iteration_time_s < \
        0.95 * pipescope.run(pipescope.load_config("demo")).iteration_time_s


def test_a_table_from_another_device_is_used_with_a_warning(tmp_path: Path) -> None:
    folder = write_table(tmp_path / "a100", [(4096, 4096, 4096, ns_at(250e12, 4096, 4096, 4096))],
                         device="NVIDIA A100-SXM4-80GB")
    result = pipescope.run(pipescope.load_config("demo", [f"costs.gemms={folder}"]))
    assert any(w.startswith("costs.gemms: measured on 'NVIDIA A100-SXM4-80GB', the cluster's GPUs are h100s")
               for w in result.warnings)


@pytest.mark.parametrize("make, sets, message", [
    (lambda d: write_table(d, [(64, 64, 64, 1000)], precision="fp32"), [],
     "measured in 'fp32'; expected the run's precision bf16"),
    (lambda d: write_table(d, [(8192, 8192, 8192, 1e6)]), [],  # 1.1 PFLOP in 1 ms: above H100's 989 TFLOP/s
     "measured 8192 x 8192 x 8192 at 1100 TFLOP/s, above the bf16 peak of cluster.topology dgx-h100"),
    (lambda d: write_table(d, [(64, 64, 64, 0)]), [], "column 'median_ns' row 1: 0; expected a time in ns above 0"),
    (lambda d: write_table(d, [(64, 0, 64, 10)]), [], "column 'n' row 1: 0; expected a whole number from 1"),
    (lambda d: write_table(d, [(64, 64, 64, 10)], header="m,n,kk,median_ns"), [], "column 'k' missing"),
    (lambda d: write_table(d, []), [], "the gemms table has 0 rows; expected 1 to 4096 measured shapes"),
    (lambda d: write_table(d, [(64, 64, 64, 10), (32, 32, 32, 5), (64, 64, 64, 12)]), [],
     "the gemms table measures 64 x 64 x 64 twice (row 3); expected each shape once"),
    (lambda d: d, [], "has no gemms.json; expected a pipescope calibrate-gemms output"),
    (lambda d: write_table(d, [(64, 64, 64, 1000)]), ["costs.efficiency=0.7"],
     "costs.efficiency: got 0.7 with costs.gemms, expected one of the two"),
])
def test_a_bad_table_is_one_line_naming_the_key(make, sets: list[str], message: str, tmp_path: Path) -> None:
    folder = tmp_path / "g"
    folder.mkdir()
    make(folder)
    with pytest.raises(pipescope.ConfigError) as err:
        pipescope.run(pipescope.load_config("demo", [f"costs.gemms={folder}", *sets]))
    text = str(err.value)
    key = "costs.efficiency" if sets else "costs.gemms"
    assert text.startswith(key) and message in text and "\n" not in text, text
