"""The GPU session's one command, rehearsed on CPU in an interpreter that has only what a lent GPU machine has
(torch, pandas, pyarrow and their requirements) plus the carried pure-Python packages, run from the source tree."""

from __future__ import annotations

import importlib.metadata as metadata
import itertools
import importlib.util
import json
import math
import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from pipescope.experiments.gpu_session import CARRIED
from pipescope.simulator.measured_gemms import load_gemms

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parent.parent
GPU_BOX = ("torch", "pandas", "pyarrow")  # what the device machine has installed


def requirements(names: tuple[str, ...]) -> set[str]:
    """The installed distributions ``names`` need, transitively (no extras)."""
    todo, seen = list(names), set()
    while todo:
        name = todo.pop()
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:  # e.g. CUDA libraries a CPU wheel does not pull in
            continue
        if dist.metadata["Name"].lower() in seen:
            continue
        seen.add(dist.metadata["Name"].lower())
        for text in dist.requires or []:
            requirement = Requirement(text)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(requirement.name)
    return seen


def link_tops(names: set[str], into: Path) -> None:
    """Link every top-level file or folder the distributions ``names`` installed into ``into``."""
    into.mkdir(parents=True, exist_ok=True)
    for name in names:
        dist = metadata.distribution(name)
        for top in {f.parts[0] for f in dist.files or [] if f.parts[0] != ".."}:
            source = Path(dist.locate_file(top))
            if source.exists() and not (into / top).exists():
                (into / top).symlink_to(source)


def gpu_box_python(folder: Path) -> tuple[Path, dict[str, str]]:
    """(a fresh interpreter with only the GPU box's packages, the environment that adds the carried ones)."""
    venv.EnvBuilder(with_pip=False, symlinks=True).create(folder / "box")
    site = folder / "box" / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    link_tops(requirements(GPU_BOX), site)
    carried = folder / "carried"  # what `make gpu-site` installs, linked from this environment
    carried.mkdir()
    for top in (top for tops in CARRIED.values() for top in tops):
        (carried / top).symlink_to(Path(importlib.util.find_spec(top).origin).parent)  # each is a package folder
    env = {**os.environ, "PYTHONPATH": str(carried), "OMP_NUM_THREADS": "1"}
    return folder / "box" / "bin" / "python", env


def test_gpu_session_runs_from_the_source_tree_with_only_the_gpu_boxs_packages(tmp_path: Path) -> None:
    """Calibrate and validate tiny on CPU (`--device cpu`, the rehearsal), each step a subprocess of the bare
    interpreter: the profile and the validation report land where the session puts them."""
    python, env = gpu_box_python(tmp_path)
    bare = subprocess.run([str(python), "-c", "import yaml"], cwd=tmp_path, capture_output=True, text=True)
    assert bare.returncode != 0 and "No module named 'yaml'" in bare.stderr  # the box really lacks them
    out = tmp_path / "out"
    done = subprocess.run([str(python), "-m", "pipescope.experiments.gpu_session", str(out), "--device", "cpu",
                           "--models", "tiny", "--budget-s", "0.05", "--iterations", "2", "--gemm-sizes", "64,128"],
                          cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:] + "".join(p.read_text()[-2000:] for p in (out / "logs").glob(
        "*.err"))
    assert all(f"gpu_session: {step} ok" in done.stderr for step in ("calibrate-gemms", "calibrate-tiny",
                                                                     "validate-tiny"))
    gemms = load_gemms(out / "profiles" / "cpu" / "gemms", "fp32")  # what costs.gemms reads
    assert sorted(point[:3] for point in gemms.points) == sorted(itertools.product((64, 128), repeat=3))
    profile = json.loads((out / "profiles" / "cpu" / "tiny" / "profile.json").read_text())
    assert profile["model"]["name"] == "tiny" and profile["microbatch_sizes"] == [1, 2, 4, 8]
    report = json.loads((out / "validation" / "cpu" / "tiny.json").read_text())
    assert {(r["stage"], r["op"]) for r in report["stage_ops"]} == {(s, op) for s in (0, 1) for op in
                                                                    ("F", "I", "W", "OPT")}
    assert report["schedule"] == "zb-h1" and math.isfinite(report["iteration_time_error"])


def test_gpu_session_checks_its_flags_before_any_step(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "pipescope.experiments.gpu_session", str(tmp_path / "o"),
                           "--iterations", "0"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stderr == (
        "pipescope: error: --iterations: got '0', expected an integer from 1 to 100\n")
    assert not (tmp_path / "o").exists()
    import torch
    if not torch.cuda.is_available():  # cuda is the default: where there is none, one line, not a traceback
        done = subprocess.run([sys.executable, "-m", "pipescope.experiments.gpu_session", str(tmp_path / "o")],
                              cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and done.stderr == ("pipescope: error: --device: got 'cuda', but torch sees no "
                                                        "CUDA device here; expected cpu (to rehearse)\n")


def test_a_step_past_its_timeout_is_stopped_with_its_children(tmp_path: Path) -> None:
    """A hung step must not take the device's whole time: it is stopped, said so, and leaves no process behind."""
    import time

    import psutil
    mark = {"GPU_SESSION_TEST_RUN": str(tmp_path)}  # inherited by every process the session starts, and only them
    done = subprocess.run([sys.executable, "-m", "pipescope.experiments.gpu_session", str(tmp_path), "--device", "cpu",
                           "--models", "tiny", "--step-timeout", "4"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={**os.environ, **mark})
    assert done.returncode == 1
    assert "gpu_session: calibrate-tiny failed (exit 124): gpu_session: stopped after 4 s" in done.stderr
    time.sleep(1)

    def marked(process: psutil.Process) -> bool:
        try:
            return process.environ().get("GPU_SESSION_TEST_RUN") == mark["GPU_SESSION_TEST_RUN"]
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
            return False

    assert [p.cmdline() for p in psutil.process_iter() if marked(p)] == []
