"""Every degree in the parallel section (issue 29): parallel.pipeline, data, bucket_size and overlap_grad_sync are
the spellings of schedule.stages, cluster.data_parallel, cluster.bucket_size and cluster.overlap_grad_sync, in a
file, a --set, a sweep's grid and the planner's base; either spelling works, and errors name the one written."""

from __future__ import annotations

import pytest

from pipescope.config import ConfigError, config_tree, load_config
from pipescope.experiments.sweep import expand

SPELLINGS = {"pipeline": 2, "data": 4, "bucket_size": "8MiB", "overlap_grad_sync": False}
OLD = {"schedule": {"stages": 2}, "cluster": {"data_parallel": 4, "bucket_size": "8MiB", "overlap_grad_sync": False}}


def test_the_parallel_sections_spellings_build_the_same_config_as_the_old_keys() -> None:
    raw = {"parallel": dict(SPELLINGS, tensor=2)}
    config = load_config(raw=raw)
    old = load_config(raw={**OLD, "parallel": {"tensor": 2}})
    assert config == old and config.schedule.stages == 2 and config.cluster.data_parallel == 4
    assert config.cluster.bucket_size == 8 << 20 and config.cluster.overlap_grad_sync is False
    assert raw == {"parallel": dict(SPELLINGS, tensor=2)}  # the caller's mapping is left as it was
    sets = [f"parallel.{key}={value}" for key, value in SPELLINGS.items()]
    assert load_config(None, sets) == load_config(raw=OLD)


def test_a_later_set_of_either_spelling_replaces_an_earlier_value() -> None:
    assert load_config(None, ["cluster.data_parallel=2", "parallel.data=4"]).cluster.data_parallel == 4
    assert load_config(None, ["parallel.data=4", "cluster.data_parallel=2"]).cluster.data_parallel == 2
    assert load_config(raw={"cluster": {"data_parallel": 2}}, sets=["parallel.data=8"]).cluster.data_parallel == 8


def test_one_file_giving_both_spellings_must_agree() -> None:
    assert load_config(raw={"parallel": {"data": 4}, "cluster": {"data_parallel": 4}}).cluster.data_parallel == 4
    with pytest.raises(ConfigError, match=r"^parallel\.data: got 4 beside cluster\.data_parallel 2, expected one of "
                                          r"them \(both name the same setting\)$") as err:
        load_config(raw={"parallel": {"data": 4}, "cluster": {"data_parallel": 2}})
    assert err.value.key == "parallel.data"


def test_an_error_names_the_spelling_written() -> None:
    with pytest.raises(ConfigError, match=r"^parallel\.data: got 0, expected an integer from 1 to 100,000$") as err:
        load_config(None, ["parallel.data=0"])
    assert err.value.key == "parallel.data"
    with pytest.raises(ConfigError, match=r"^cluster\.data_parallel: got 0, expected an integer"):
        load_config(None, ["cluster.data_parallel=0"])
    with pytest.raises(ConfigError, match=r"^cluster\.data_parallel: got 0, expected an integer"):  # the last set's
        load_config(None, ["parallel.data=4", "cluster.data_parallel=0"])
    with pytest.raises(ConfigError, match=r"^parallel\.pipeline: got 'x', expected a plain decimal integer"):
        load_config(None, ["parallel.pipeline=x"])


def test_a_mistyped_parallel_key_is_matched_against_every_spelling() -> None:
    """The unknown-key list of the parallel section names its spellings too, so the suggestion can be one."""
    with pytest.raises(ConfigError, match=r"parallel.dat: unknown key, expected one of .*parallel.data, "
                                          r".*\(did you mean parallel.data\?\)"):
        load_config(None, ["parallel.dat=2"])


def test_a_sweep_over_the_parallel_spelling_sweeps_the_degree_and_names_its_column() -> None:
    grid = {"costs": {"kind": "uniform"}, "cluster": {"data_parallel": 2}, "sweep": {"parallel.data": [1, 2]}}
    plan = expand(grid)
    assert plan.keys == ("cluster.data_parallel",)  # the results' column, which plot throughput reads
    assert [run.config.cluster.data_parallel for run in plan.runs] == [1, 2]  # the grid, not the base, decides
    with pytest.raises(ConfigError, match=r"^sweep\.parallel\.data: beside sweep\.cluster\.data_parallel"):
        expand({"sweep": {"parallel.data": [1], "cluster.data_parallel": [2]}})


def test_the_planners_base_holds_each_degree_at_its_home() -> None:
    """The planner reads the file's keys to say which the search sets: parallel.data is cluster.data_parallel."""
    assert config_tree(raw={"parallel": {"data": 2, "tensor": 2}}) == {"parallel": {"tensor": 2},
                                                                      "cluster": {"data_parallel": 2}}
