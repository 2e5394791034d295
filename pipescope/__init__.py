"""pipescope: predict iteration time, bubbles and memory of pipeline-parallel training before renting the GPUs.

The public API (``__all__``) is loaded lazily, so ``import pipescope.simulator.ir`` on a GPU box that has torch but
none of the simulator's dependencies imports nothing heavy. The subpackages are the repository's top-level
folders (``simulator/``, ``topologies/``, ``calibration/``, ``executor/``, ``experiments/``), installed as
``pipescope.simulator`` and so on; see docs/architecture.md.

Example::

    import pipescope
    config = pipescope.Config(schedule=pipescope.ScheduleConfig("zb-v", stages=4, microbatches=8))
    result = pipescope.run(config)
    print(result.iteration_time_s, result.bubble_rate)
"""

from __future__ import annotations

import importlib
import os
from typing import Any

__version__ = "0.1.0"

# Run from a source checkout without installing (e.g. calibration on a GPU box): the subpackages are the
# folders beside this one. An installed copy has them inside this folder and never takes this branch.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if os.path.isfile(os.path.join(_ROOT, "simulator", "ir.py")) and _ROOT not in __path__:
    __path__.append(_ROOT)

# Public name -> the module that defines it.
_EXPORTS = {
    "Config": "pipescope.config",
    "ConfigError": "pipescope.config",
    "load_config": "pipescope.config",
    "run": "pipescope.runner",
    "simulate": "pipescope.simulator.simulate",
    "SimResult": "pipescope.simulator.result",
    "Schedule": "pipescope.simulator.ir",
    "Action": "pipescope.simulator.ir",
    "ActionKind": "pipescope.simulator.ir",
    "ScheduleError": "pipescope.simulator.check",
    "ScheduleConfig": "pipescope.simulator.schedules",
    "build_schedule": "pipescope.simulator.schedules",
    "GENERATORS": "pipescope.simulator.schedules",
    "ModelConfig": "pipescope.simulator.models",
    "ClusterConfig": "pipescope.topologies.cluster",
    "UniformCostsConfig": "pipescope.simulator.costs",
    "AnalyticCostsConfig": "pipescope.simulator.costs",
    "ProfiledCostsConfig": "pipescope.simulator.profiled",
    "FaultsConfig": "pipescope.simulator.faults",
    "ParallelConfig": "pipescope.simulator.parallel",
    "MemoryConfig": "pipescope.simulator.memory_runtime",
    "plan": "pipescope.experiments.plan",
    "PlanRequest": "pipescope.experiments.plan_space",
    "PlanReport": "pipescope.experiments.plan",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    """Import a public name on first use (PEP 562)."""
    if name not in _EXPORTS:
        raise AttributeError(f"module 'pipescope' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
