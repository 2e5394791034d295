"""The library API: ``import pipescope``, the README's Python example, and what ``pip install`` puts on the path."""

from __future__ import annotations

import dataclasses
import typing
import os
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
    hints = typing.get_type_hints(pipescope.Config)
    sections = {t for hint in hints.values() for t in typing.get_args(hint) or (hint,) if dataclasses.is_dataclass(t)}
    assert len(sections) >= 9 and all(getattr(pipescope, t.__name__) is t for t in sections)  # each section's class
    with pytest.raises(AttributeError, match="no attribute 'frobnicate'"):
        pipescope.frobnicate  # noqa: B018


def test_uniform_run_equals_the_closed_form_through_the_api() -> None:
    """A config built in Python: 1F1B p=4 m=8 with unit F, I, W gives (m+p-1)(F+B) = 33 s and 27.27% bubble."""
    config = pipescope.Config(schedule=pipescope.ScheduleConfig("1f1b", stages=4, microbatches=8),
                              costs=pipescope.UniformCostsConfig(forward=1, backward_input=1, backward_weight=1))
    result = pipescope.run(config)
    assert result.iteration_time_s == 33.0
    assert result.bubble_rate == pytest.approx(3 / 11)
    assert result.config == dataclasses.replace(config, model=dataclasses.replace(config.model, precision="bf16"),
                                                schedule=dataclasses.replace(config.schedule, chunks=1))
    zbv = pipescope.run(pipescope.Config(schedule=pipescope.ScheduleConfig("zb-v", stages=2, microbatches=4)))
    assert zbv.config.schedule.chunks == 2  # the chunks the schedule ran, where the config left them to it


def test_the_results_config_says_what_ran_where_the_config_left_it_unset() -> None:
    """A notebook reads p, m and the preset back from the result, and running that config again gives the same run;
    what follows from them (the model's shape, the iterations) stays unset, so that a config changed from it with
    replace() takes its own (a shape filled in made another preset run the old model under its name)."""
    result = pipescope.run(pipescope.Config())
    s, m = result.config.schedule, result.config.model
    assert (s.stages, s.microbatches, s.chunks, m.preset, m.layers, result.config.iterations) == \
        (4, 8, 1, "gpt-1.3b", None, None)
    assert pipescope.run(result.config).iteration_ns == result.iteration_ns
    small = dataclasses.replace(result.config, model=dataclasses.replace(m, preset="gpt-355m"))
    assert pipescope.run(small).iteration_ns == pipescope.run(
        pipescope.Config(model=pipescope.ModelConfig("gpt-355m"))).iteration_ns < result.iteration_ns
    custom = pipescope.ModelConfig(layers=4, hidden=256, heads=4, seq=128, vocab=1000)
    assert pipescope.run(pipescope.Config(model=custom)).config.model.preset is None  # every dimension given: custom
    one = pipescope.run(pipescope.Config(schedule=pipescope.ScheduleConfig("2bw"), iterations=1))
    assert one.schedule.iterations == 1  # not the generator's default of 3
    assert pipescope.run(dataclasses.replace(one.config, iterations=None)).schedule.iterations == 3


def test_a_result_prints_as_one_line_and_equals_only_itself() -> None:
    """A notebook cell ending in a result shows one line, not the schedule and timeline (100 KB)."""
    result = pipescope.run(pipescope.Config())
    assert repr(result) == ("<SimResult 1f1b p=4 m=8 v=1: iteration 69.346 ms, bubble rate 37.43%, peak memory "
                            "10.21 GiB, 168 actions>")
    assert result == result and result != pipescope.run(pipescope.Config())  # no array comparison raising
    assert type(result.devices[0].busy_s) is float and type(result.devices[0].peak_memory_bytes) is int
    uniform = pipescope.run(pipescope.Config(costs=pipescope.UniformCostsConfig()))
    assert "no memory counted" in repr(uniform)


def test_library_errors_name_the_key_without_cli_terms() -> None:
    """A bad value is a ConfigError naming the dotted key; nothing about flags or exit codes."""
    with pytest.raises(pipescope.ConfigError, match=r"^schedule\.name: got 'nope', expected one of") as err:
        pipescope.run(pipescope.Config(schedule=pipescope.ScheduleConfig("nope")))
    assert err.value.key == "schedule.name" and "--" not in str(err.value)
    with pytest.raises(pipescope.ConfigError, match=r"^sets: got 'schedule.stages=8', expected a list of dotted"):
        pipescope.load_config(None, "schedule.stages=8")  # a string, not a list: not read character by character
    with pytest.raises(pipescope.ConfigError, match=r"^sets: got \[\('schedule.stages', 8\)\], expected a list"):
        pipescope.load_config(None, [("schedule.stages", 8)])
    with pytest.raises(pipescope.ConfigError, match=r"^path: got \{'schedule': \{\}\} \(dict\), expected a file "
                       r"name or None \(a mapping of keys goes in raw=\)$"):
        pipescope.load_config({"schedule": {}})
    placed = pipescope.run(pipescope.Config(cluster=pipescope.ClusterConfig(placement=(3, 2, 1, 0))))
    assert placed.config.cluster.placement == "3,2,1,0"  # a list of ranks is the comma-separated text


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
                "configs/demo.yaml", "executor/run.py", "experiments/cli.py"):
        assert f"pipescope/{sub}" in names, sub


def test_planner_example_runs_and_its_best_is_the_first_ranked(capsys) -> None:
    """docs/planner.md's Python example runs as printed, through the public ``pipescope.plan``."""
    match = re.search(r"```python\n(.*?)```", (ROOT / "docs" / "planner.md").read_text(), re.S)
    assert match, "docs/planner.md has no python example"
    scope: dict = {"__name__": "__main__"}  # as a script runs it: the example's work is under the main guard
    exec(compile(match.group(1), "docs/planner.md", "exec"), scope)  # noqa: S102 (the project's own docs)
    report = scope["report"]
    assert isinstance(report, pipescope.PlanReport) and report.best == report.ranked[0]
    assert report.best["schedule"] in ("1f1b", "zb-h1") and report.best["tensor"] in (1, 2)
    speeds = [row["throughput_samples_per_s"] for row in report.ranked]
    assert speeds == sorted(speeds, reverse=True)  # every simulated plan that fits, fastest first
    assert capsys.readouterr().out.split()[0] == report.best["schedule"]


def python_examples(doc: Path) -> list[str]:
    """Every ```python block of a markdown file."""
    return re.findall(r"```python\n(.*?)```", doc.read_text(), re.S)


def test_doc_examples_that_start_workers_guard_them() -> None:
    """A script that starts worker processes keeps that under ``if __name__ == "__main__":``: each worker starts by
    importing the script again (forkserver, spawn), and an unguarded one would start workers from a worker."""
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    starting = [(doc.name, code) for doc in docs for code in python_examples(doc)
                if re.search(r"workers=|dask_executor\(|run_sweep\(|\bplan\(", code)]
    assert len(starting) >= 3  # planner.md's, and sweeps.md's process pool and Dask cluster
    for name, code in starting:
        assert '\nif __name__ == "__main__":\n' in code, f"{name}: {code.splitlines()[0]}"


@pytest.mark.parametrize("doc", ["planner.md", "sweeps.md"])
def test_doc_examples_that_start_workers_run_as_scripts_from_any_folder(doc: str, tmp_path: Path) -> None:
    """The first Python example of each page, pasted into a script and run outside the repository."""
    script = tmp_path / "example.py"
    script.write_text(python_examples(ROOT / "docs" / doc)[0])
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=180,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert done.stdout.strip()


def demo_in_python() -> pipescope.Config:
    """pipescope/configs/demo.yaml, built in Python."""
    return pipescope.Config(schedule=pipescope.ScheduleConfig("1f1b", stages=4, microbatches=8),
                            model=pipescope.ModelConfig("gpt-1.3b", microbatch_size=4, precision="bf16"),
                            cluster=pipescope.ClusterConfig("dgx-h100", nodes=1),
                            costs=pipescope.AnalyticCostsConfig())


# What a new user passed; each raised nothing, or a TypeError or AttributeError from deep inside the run.
BAD_PYTHON_CONFIGS = [
    pytest.param(pipescope.Config(costs=pipescope.AnalyticCostsConfig(efficiency=2.0)), "costs.efficiency",
                 "got 2.0, expected a number in (0, 1]", id="efficiency-over-1"),
    pytest.param(pipescope.Config(model=pipescope.ModelConfig("gpt-1.3b", microbatch_size=0)), "model.microbatch_size",
                 "got 0, expected an integer from 1 to", id="microbatch-0"),
    pytest.param(pipescope.Config(schedule=pipescope.ScheduleConfig("1f1b", stages="4")), "schedule.stages",
                 "got '4' (str), expected int", id="stages-str"),
    pytest.param(pipescope.Config(schedule=pipescope.ScheduleConfig("1f1b", stages=True)), "schedule.stages",
                 "got True (bool), expected an integer", id="stages-bool"),
    pytest.param(pipescope.Config(schedule=pipescope.ScheduleConfig("1f1b", stages=4.0)), "schedule.stages",
                 "got 4.0 (float), expected", id="stages-float"),
    pytest.param(pipescope.Config(schedule="1f1b"), "schedule", "got '1f1b', expected ScheduleConfig",
                 id="schedule-str"),
    pytest.param(pipescope.Config(costs=None), "costs", "got None, expected AnalyticCostsConfig or", id="costs-none"),
    pytest.param(pipescope.Config(costs=pipescope.UniformCostsConfig(forward="2ms")), "costs.forward",
                 "got '2ms' (str), expected float, e.g. 0.002", id="time-as-text"),
    pytest.param(pipescope.Config(costs=pipescope.AnalyticCostsConfig(kind="uniform")), "costs.kind",
                 "got 'uniform' in AnalyticCostsConfig, expected analytic", id="kind-of-another-class"),
    pytest.param("demo", "config", "got 'demo', expected Config", id="not-a-config"),
    pytest.param(pipescope.Config(schedule=pipescope.ScheduleConfig("1f1b", recompute="ful")), "schedule.recompute",
                 "got 'ful', expected one of none, selective, full", id="recompute-typo"),  # not at construction
    pytest.param(pipescope.Config(schedule=pipescope.ScheduleConfig(4)), "schedule.name",
                 "got 4 (int), expected str", id="name-int"),  # and no "e.g. '4'", which is no name
    pytest.param(pipescope.Config(cluster=pipescope.ClusterConfig(placement=[0, 1, 2, 99])), "cluster.placement",
                 "GPU 99 does not exist", id="placement-list"),
    pytest.param(pipescope.Config(cluster=pipescope.ClusterConfig(memory=16)), "cluster.memory",
                 "got 16 B, expected a size from 1.00 MiB", id="memory-without-unit"),
    pytest.param(pipescope.Config(schedule=pipescope.ScheduleConfig("1f1b"), iterations=3), "iterations",
                 "got 3, expected none: 1f1b has a flush", id="iterations-of-a-flush"),
]


@pytest.mark.parametrize(("config", "key", "message"), BAD_PYTHON_CONFIGS)
def test_a_python_built_config_is_checked_like_yaml(config: pipescope.Config, key: str, message: str) -> None:
    """``pipescope.run`` and ``runner.prepare`` refuse a bad Python-built config as ``load_config`` refuses a bad
    file: one line, ``ConfigError`` naming the dotted key, the value and what was expected."""
    from pipescope.runner import prepare

    for entry in (pipescope.run, prepare):
        with pytest.raises(pipescope.ConfigError) as err:
            entry(config)
        assert err.value.key == key and str(err.value).startswith(f"{key}: {message}"), str(err.value)
        assert "\n" not in str(err.value)


def test_a_python_built_config_runs_as_the_same_values_from_yaml() -> None:
    """demo.yaml built in Python equals what ``load_config`` reads, and runs to the same result."""
    config, loaded = demo_in_python(), pipescope.load_config("demo")
    assert config == loaded
    python, yaml = pipescope.run(config), pipescope.run(loaded)
    assert python.config == yaml.config
    assert (python.iteration_time_s, python.mfu, python.peak_memory_bytes) == \
        (yaml.iteration_time_s, yaml.mfu, yaml.peak_memory_bytes)
    assert python.timeline.equals(yaml.timeline)


def test_check_config_returns_what_load_config_builds() -> None:
    """An int where a float belongs and a list where a tuple belongs are the same values (converted as YAML's are);
    every shipped config comes back unchanged, so checking twice changes nothing."""
    from pipescope.config import EXPERIMENT_KEYS, _shipped_configs, check_config, load_config, read_yaml

    config = pipescope.Config(costs=pipescope.AnalyticCostsConfig(efficiency=1),
                              model=pipescope.ModelConfig(layers_per_stage=[6, 6, 6, 6]))
    checked = check_config(config)
    assert checked.costs == config.costs and type(checked.costs.efficiency) is float
    assert checked.model.layers_per_stage == (6, 6, 6, 6)
    # numpy's integers and a path object, as scripts build them, are the same values too
    import numpy as np
    from pipescope.simulator.profiled import ProfiledCostsConfig
    config = pipescope.Config(schedule=pipescope.ScheduleConfig("1f1b", stages=np.int64(4), microbatches=np.int32(8)),
                              costs=ProfiledCostsConfig(profile=Path("profiles/x")), seed=np.int64(3))
    checked = check_config(config)
    assert (checked.schedule.stages, checked.schedule.microbatches, checked.seed) == (4, 8, 3)
    assert type(checked.schedule.stages) is int and checked.costs.profile == "profiles/x"
    for name in _shipped_configs():
        loaded = load_config(raw={k: v for k, v in read_yaml(name).items() if k not in EXPERIMENT_KEYS})
        assert check_config(loaded) == loaded, name


def test_the_result_says_which_recompute_ran_and_oom_is_false_when_everything_fits() -> None:
    """``summary()['recompute']`` is the mode, not whether forwards rerun (selective read as false); ``oom`` is an
    attribute like every other result field, so ``if result.oom:`` means what it says."""
    fits = pipescope.run(pipescope.load_config("demo", ["schedule.recompute=selective"]))
    assert fits.summary()["recompute"] == "selective" and fits.oom == [] and not fits.oom
    tight = pipescope.run(pipescope.load_config("demo", ["cluster.memory=4GiB"]))
    assert tight.oom and {row["device"] for row in tight.oom} == {d.device for d in tight.devices
                                                                 if d.peak_memory_bytes > 4 * 2**30}
    assert tight.summary()["oom"] == tight.oom and tight.summary()["recompute"] == "none"


def test_load_config_leaves_the_callers_mapping_and_refuses_what_it_would_drop() -> None:
    """The sets merged into the caller's raw mapping, so the next config built from it had them too; a raw beside a
    path was dropped silently; a ZeRO stage beside the older distributed_optimizer in a Config built in Python ran
    the stage and dropped the flag; a uniform run's memory picture was an empty chart."""
    base = {"schedule": {"name": "1f1b", "stages": 4}, "cluster": {"topology": "dgx-h100"}}
    assert pipescope.load_config(raw=base, sets=["cluster.data_parallel=2"]).cluster.data_parallel == 2
    assert base == {"schedule": {"name": "1f1b", "stages": 4}, "cluster": {"topology": "dgx-h100"}}
    with pytest.raises(pipescope.ConfigError, match=r"^raw: given beside path 'demo', expected one of the two"):
        pipescope.load_config("demo", raw={"schedule": {"stages": 2}})
    with pytest.raises(pipescope.ConfigError, match=r"^raw: got 'schedule: \{\}' \(str\), expected a mapping"):
        pipescope.load_config(raw="schedule: {}")
    config = pipescope.Config(cluster=pipescope.ClusterConfig(data_parallel=2),
                              parallel=pipescope.ParallelConfig(zero=2, distributed_optimizer=True))
    with pytest.raises(pipescope.ConfigError, match=r"^parallel.distributed_optimizer: got true beside parallel.zero"):
        pipescope.run(config)
    from pipescope.experiments.plots import memory_figure

    uniform = pipescope.run(pipescope.load_config(None, ["costs.kind=uniform"]))
    with pytest.raises(ValueError, match=r"^memory: the run counted no bytes"):
        memory_figure(uniform)
    assert uniform.summary()["model"] is None
