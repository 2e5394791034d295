"""The library API: ``import pipescope``, the README's Python example, and what ``pip install`` puts on the path."""

from __future__ import annotations

import dataclasses

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import pipescope

ROOT = Path(__file__).resolve().parents[1]


def readme_example() -> str:
    """The first ```python block of the README."""
    match = re.search(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert match, "README has no python example"
    return match.group(1)


def test_readme_example_runs_and_the_result_knows_its_inputs() -> None:
    """The README's example runs as printed; its result carries the config it came from."""
    code = readme_example()
    assert len(code.strip().splitlines()) <= 12
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)  # noqa: S102 (the project's own README)
    result = scope["result"]
    assert isinstance(result, pipescope.SimResult)
    assert result.config.schedule.name == "zb-v" and result.config.schedule.stages == 4
    assert result.iteration_time_s > 0 and 0 <= result.bubble_rate < 1


def test_public_api_is_declared_and_importable() -> None:
    """Every name in __all__ resolves; the config sections are the components' own dataclasses."""
    for name in pipescope.__all__:
        assert getattr(pipescope, name) is not None, name
    assert pipescope.ScheduleConfig.__module__ == "pipescope.simulator.schedules"
    assert pipescope.ClusterConfig.__module__ == "pipescope.topologies.cluster"
    with pytest.raises(AttributeError, match="no attribute 'frobnicate'"):
        pipescope.frobnicate  # noqa: B018


def test_uniform_run_equals_the_closed_form_through_the_api() -> None:
    """A config built in Python: 1F1B p=4 m=8 with unit F, I, W gives (m+p-1)(F+B) = 33 s and 27.27% bubble."""
    config = pipescope.Config(schedule=pipescope.ScheduleConfig("1f1b", stages=4, microbatches=8),
                              costs=pipescope.UniformCostsConfig(forward=1, backward_input=1, backward_weight=1))
    result = pipescope.run(config)
    assert result.iteration_time_s == 33.0
    assert result.bubble_rate == pytest.approx(3 / 11)
    assert result.config == dataclasses.replace(config, model=dataclasses.replace(config.model, precision="bf16"))


def test_library_errors_name_the_key_without_cli_terms() -> None:
    """A bad value is a ConfigError naming the dotted key; nothing about flags or exit codes."""
    with pytest.raises(pipescope.ConfigError, match=r"^schedule\.name: got 'nope', expected one of") as err:
        pipescope.run(pipescope.Config(schedule=pipescope.ScheduleConfig("nope")))
    assert err.value.key == "schedule.name" and "--" not in str(err.value)


def test_wheel_installs_only_the_pipescope_package(tmp_path: Path) -> None:
    """The built wheel holds one top-level package, pipescope (its subpackages are the repo's folders), plus the
    data files; no generic top-level name such as simulator or experiments."""
    source = tmp_path / "src"  # setuptools builds inside the project folder: build a copy, not the work tree
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".venv", ".git", "build", "*.egg-info", "__pycache__",
                                                                  "demo-out"))
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(tmp_path), str(source)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    (wheel,) = tmp_path.glob("pipescope-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {name.split("/")[0] for name in names}
    assert tops == {"pipescope", next(t for t in tops if t.endswith(".dist-info"))}
    for sub in ("simulator/engine.py", "topologies/machines/dgx-h100.yaml", "calibration/comms.py",
                "experiments/configs/demo.yaml", "experiments/cli.py"):
        assert f"pipescope/{sub}" in names, sub


def test_planner_example_runs_and_its_best_is_the_first_ranked(capsys) -> None:
    """docs/planner.md's Python example runs as printed, through the public ``pipescope.plan``."""
    match = re.search(r"```python\n(.*?)```", (ROOT / "docs" / "planner.md").read_text(), re.S)
    assert match, "docs/planner.md has no python example"
    scope: dict = {}
    exec(compile(match.group(1), "docs/planner.md", "exec"), scope)  # noqa: S102 (the project's own docs)
    report = scope["report"]
    assert isinstance(report, pipescope.PlanReport) and report.best == report.ranked[0]
    assert report.best["schedule"] in ("1f1b", "zb-h1") and report.best["tensor"] in (1, 2)
    speeds = [row["throughput_samples_per_s"] for row in report.ranked]
    assert speeds == sorted(speeds, reverse=True)  # every simulated plan that fits, fastest first
    assert capsys.readouterr().out.split()[0] == report.best["schedule"]
