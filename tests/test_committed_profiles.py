"""The profiles a GPU session committed under ``calibration/profiles/<gpu>/`` (docs/validation.md, "On an H200"):
each loads under today's checks, sits in the folder its GPU and model name, and runs a simulation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipescope.experiments.cli import main
from pipescope.experiments.gpu_session import folder_name
from pipescope.simulator.measured_gemms import load_gemms
from pipescope.topologies.devices import DEVICES

PROFILES = Path(__file__).resolve().parent.parent / "calibration" / "profiles"
COMPUTE = sorted(path.parent for path in PROFILES.glob("*/*/profile.json"))
GEMMS = sorted(path.parent for path in PROFILES.glob("*/gemms/gemms.json"))
TOPOLOGY = {"h200": "hgx-h200", "h100-80gb-hbm3": "dgx-h100"}  # a cluster of each profiled GPU


def test_a_gpu_session_left_profiles() -> None:
    assert COMPUTE and GEMMS


@pytest.mark.parametrize("folder", COMPUTE, ids=lambda path: f"{path.parent.name}/{path.name}")
def test_a_committed_profile_is_where_its_gpu_and_model_say_and_simulates(
        folder: Path, capsys: pytest.CaptureFixture) -> None:
    meta = json.loads((folder / "profile.json").read_text())
    assert folder_name(meta["device"]["name"]) == folder.parent.name and meta["model"]["name"] == folder.name
    assert "/tmp" not in meta["command"]  # the command names the repo's folder, not the machine's
    code = main(["simulate", "--schedule", "1f1b", "--stages", "2", "--microbatches", "4", "--json",
                 "--set", "costs.kind=profile", "--set", f"costs.profile={folder}",
                 "--set", f"cluster.topology={TOPOLOGY[folder.parent.name]}"])
    result = json.loads(capsys.readouterr().out)
    assert code == 0 and result["iteration_time_s"] > 0
    # the one warning a committed profile may carry: the rows calibrate itself listed as noisy
    assert [w.split(" stayed")[0] for w in result["warnings"]] == \
        ([f"costs.profile: {len(meta['noisy_rows'])} timing rows"] if meta["noisy_rows"] else [])


@pytest.mark.parametrize("folder", GEMMS, ids=lambda path: path.parent.name)
def test_a_committed_gemm_table_is_its_gpus_at_its_datasheet_class(folder: Path) -> None:
    """The fastest shape runs between the published large-GEMM rate the analytic model is anchored at (the GPU
    is one of its kind) and the dense peak (no other GPU's table)."""
    table = load_gemms(folder, "bf16")
    device = DEVICES[folder.parent.name]
    assert folder_name(table.device_name) == folder.parent.name
    fastest = table.fastest()[1]
    assert device.gemm_measured * device.peak_flops["bf16"] <= fastest < device.peak_flops["bf16"]
