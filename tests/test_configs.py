"""Every config shipped in pipescope/configs loads and simulates: a plain config as it is, an experiment file
(``sweep:``/``zip:``) through ``experiments.sweep.expand``, its first and last run."""

import glob
import json
import os

import pytest

from pipescope import run
from pipescope.config import read_yaml
from pipescope.experiments.sweep import expand

CONFIGS = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "..", "pipescope", "configs", "*.yaml")))


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_shipped_config_simulates(path: str) -> None:
    """Each file is valid, and its first and last runs have a positive iteration time; a plain config fits in
    memory (a sweep may explore past the memory, as the papers' OOM entries do)."""
    runs = expand(path).runs
    for item in {id(r): r for r in (runs[0], runs[-1])}.values():
        result = run(item.config)
        assert result.iteration_ns > 0
        assert len(runs) > 1 or result.oom == []


def test_there_are_configs() -> None:
    """The demo and the hardware-named recipes are found."""
    assert len(CONFIGS) >= 4


def test_an_experiment_file_given_to_load_config_builds_its_config_and_says_so() -> None:
    """load_config refused an experiment file that simulate --config runs; both now run its config without the
    grid and say so (a warning in Python, a note on stderr from the command line)."""
    from pipescope import load_config
    from pipescope.config import ConfigError
    grid = next(path for path in CONFIGS if path.endswith("zero-bubble-paper.yaml"))
    with pytest.warns(UserWarning, match=r"zero-bubble-paper.yaml: building its config without its sweep grid "
                                         r"\(pipescope sweep runs the grid"):
        config = load_config(grid, ["schedule.name=zb-v"])
    assert config.schedule.name == "zb-v" and config.schedule.stages == 8
    refused = r"^sweep: a key of experiment files .* pipescope sweep runs"  # not "unknown key (did you mean seed?)"
    with pytest.warns(UserWarning), pytest.raises(ConfigError, match=refused):
        load_config(grid, ["sweep.schedule.name=[1f1b]"])


def test_simulate_runs_an_experiment_files_config_without_its_grid(cli) -> None:
    """From the command line, --config on an experiment file runs its config; --set picks a point of the grid."""
    code, out, err = cli(["simulate", "--config", "dgx-a100-gpt-1.3b-zero-bubble-paper", "--set", "schedule.name=zb-v",
                          "--json"])
    assert code == 0 and json.loads(out)["schedule"] == "zb-v" and json.loads(out)["devices"] == 8
    assert "running its config without its sweep grid" in err


def test_file_names_in_a_config_file_are_read_beside_it(tmp_path, monkeypatch) -> None:
    """A CSV schedule, a topology file, a profile folder, a sweep's list of CSVs and a swept whole section, named
    relative to a config file, are found next to it from any working folder, as absolute names (so a sweep's run
    ids do not depend on where it ran from); absolute names, ~ and built-in names are kept; a --set value is still
    read from the working folder."""
    from pipescope import ScheduleConfig, load_config
    from pipescope.config import ConfigError
    from pipescope.experiments.report import table
    from pipescope.simulator.readers.csvio import to_csv_text
    from pipescope.simulator.schedules import build_schedule
    from pipescope.topologies.topology_io import load_topology, save_topology

    sub = tmp_path / "sub"
    sub.mkdir()
    two, box = sub / "two.csv", sub / "box.yaml"
    two.write_text(to_csv_text(build_schedule(ScheduleConfig(name="1f1b", stages=2, microbatches=2))))
    save_topology(load_topology("dgx-h100"), box)
    (sub / "c.yaml").write_text("schedule: {name: 'csv:two.csv'}\ncluster: {topology: box.yaml}\n"
                                "costs: {kind: uniform}\n")
    (sub / "grid.yaml").write_text("costs: {kind: uniform}\nsweep:\n  schedule.name: ['csv:two.csv', 1f1b]\n")
    (sub / "section.yaml").write_text("costs: {kind: uniform}\nsweep:\n  schedule: [{name: 'csv:two.csv'}, "
                                      "{name: 1f1b}]\n")
    (sub / "p.yaml").write_text(f"costs: {{kind: profile, profile: prof}}\nschedule: {{name: 'csv:{two}'}}\n"
                                "cluster: {topology: dgx-a100}\n")
    monkeypatch.chdir(tmp_path)
    config = load_config("sub/c.yaml")
    assert (config.schedule.name, config.cluster.topology) == (f"csv:{two}", str(box))
    result = run(config)
    assert result.schedule.num_devices == 2 and f"on dgx-h100 ({box}) x1" in table(result)
    runs = expand("sub/grid.yaml").runs
    assert sorted(r.config.schedule.name for r in runs) == ["1f1b", f"csv:{two}"]
    assert sorted(r.config.schedule.name for r in expand("sub/section.yaml").runs) == ["1f1b", f"csv:{two}"]
    monkeypatch.chdir(sub)
    assert sorted(r.run_id for r in expand("grid.yaml").runs) == sorted(r.run_id for r in runs)
    raw = read_yaml(str(sub / "p.yaml"))  # the profile folder need not exist to be named
    assert (raw["costs"]["profile"], raw["schedule"]["name"], raw["cluster"]["topology"]) == (
        str(sub / "prof"), f"csv:{two}", "dgx-a100")
    (sub / "home.yaml").write_text("costs: {kind: profile, profile: ~/prof}\n")
    assert read_yaml(str(sub / "home.yaml"))["costs"]["profile"] == os.path.expanduser("~/prof")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="two.csv"):  # a --set is the working folder's: there is none here
        run(load_config("sub/c.yaml", ["schedule.name=csv:two.csv"]))


def test_a_placement_list_in_yaml_is_the_comma_separated_ranks(tmp_path) -> None:
    """docs/cli.md: `cluster.placement` takes `[0, 8, 1, 9]` in YAML as it takes `0,8,1,9` from --set."""
    from pipescope import load_config
    from pipescope.config import ConfigError
    (tmp_path / "list.yaml").write_text("cluster:\n  nodes: 2\n  placement: [0, 8, 1, 9]\n")
    assert load_config(str(tmp_path / "list.yaml")) == load_config(None, ["cluster.nodes=2",
                                                                           "cluster.placement=0,8,1,9"])
    (tmp_path / "bad.yaml").write_text("cluster:\n  placement: [0, 1, 2, -3]\n")
    with pytest.raises(ConfigError, match=r"^cluster\.placement: got -3 at entry 4, expected an integer from 0 to"):
        load_config(str(tmp_path / "bad.yaml"))
