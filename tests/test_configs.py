"""Every config shipped in experiments/configs loads and simulates: a plain config as it is, an experiment file
(``sweep:``/``zip:``) through ``experiments.sweep.expand``, its first and last run."""

import glob
import os

import pytest

from pipescope import run
from pipescope.experiments.sweep import expand

CONFIGS = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "..", "experiments", "configs", "*.yaml")))


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


def test_an_experiment_file_given_as_one_config_points_to_sweep() -> None:
    from pipescope import load_config
    from pipescope.config import ConfigError
    grid = next(path for path in CONFIGS if path.endswith("zero-bubble-paper.yaml"))
    with pytest.raises(ConfigError, match=r"^sweep: a key of experiment files .* run this file with pipescope sweep"):
        load_config(grid)
