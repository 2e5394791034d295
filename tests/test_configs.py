"""Every config shipped in experiments/configs loads and simulates."""

import glob
import os

import pytest

from pipescope import load_config, run

CONFIGS = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "..", "experiments", "configs", "*.yaml")))


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_shipped_config_simulates(path: str) -> None:
    """Each file is a valid config whose run fits in memory and has a positive iteration time."""
    result = run(load_config(path))
    assert result.iteration_ns > 0
    assert result.oom() == []


def test_there_are_configs() -> None:
    """The demo and the hardware-named recipes are found."""
    assert len(CONFIGS) >= 4
