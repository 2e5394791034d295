"""``schedule.vocab`` applied to a run: the checks, redistribute's layer split, the sharded cost model and the
schedule with its S and T passes (docs/schedules.md section 7). ``pipescope.runner`` calls ``apply_vocab`` once."""

from __future__ import annotations

import dataclasses

from pipescope.config import Config, ConfigError
from pipescope.simulator.costs import AnalyticCosts, CostModel, UniformCostsConfig, stage_costs
from pipescope.simulator.ir import ActionKind, Schedule
from pipescope.simulator.models import ModelSpec, stage_layers
from pipescope.simulator.profiled import ProfiledCosts
from pipescope.simulator.program import op_durations
from pipescope.simulator.vocab import (
    SHARDED,
    VocabMethod,
    VocabShards,
    balance_layers,
    collective_bytes,
    vocab_method,
)
from pipescope.simulator.vocab_placement import vocab_schedule


def apply_vocab(config: Config, schedule: Schedule, costs: CostModel, model: ModelSpec | None,
                ) -> tuple[Config, Schedule, CostModel]:
    """The run's config, schedule and cost model under ``schedule.vocab``.

    ``naive`` leaves them alone; ``redistribute`` picks ``model.layers_per_stage`` (``balance_layers``) and records
    it in the config; the sharded methods move the vocabulary layers off the first and last stage into every
    device's S and T passes. ConfigError (one line, naming the keys) for a combination that does not exist.
    """
    try:
        method = vocab_method(config.schedule.vocab, config.schedule.name)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    if method is VocabMethod.NAIVE:
        return config, schedule, costs
    if schedule.pipelines > 1:
        raise ConfigError(f"schedule.vocab: {method.value} with schedule.name {schedule.name} is not modelled (its "
                          f"{schedule.pipelines} pipelines each end in their own output layer); expected naive")
    if config.parallel.tensor > 1 and method is not VocabMethod.REDISTRIBUTE:
        raise ConfigError(f"schedule.vocab: {method.value} with parallel.tensor={config.parallel.tensor} is not "
                          f"modelled (vocabulary shards split again over the tensor group); expected naive or "
                          f"redistribute with tensor parallelism, or parallel.tensor 1")
    if config.parallel.context > 1 and method is not VocabMethod.REDISTRIBUTE:
        raise ConfigError(f"schedule.vocab: {method.value} with parallel.context={config.parallel.context} is not "
                          f"modelled (each vocabulary shard's tokens split again over the context group); expected "
                          f"naive or redistribute with context parallelism, or parallel.context 1")
    if isinstance(config.costs, UniformCostsConfig) and method is VocabMethod.REDISTRIBUTE:
        raise ConfigError("schedule.vocab: redistribute moves transformer layers, which costs.kind uniform does not "
                          "model; expected costs.kind analytic or profile")
    if method is VocabMethod.REDISTRIBUTE:
        return _redistributed(config, schedule, costs)
    costs, nbytes = _sharded(config, schedule, costs, model, method)
    durations = op_durations(stage_costs(costs, schedule), schedule.recompute)
    return config, vocab_schedule(schedule, method, durations, nbytes), costs


def _redistributed(config: Config, schedule: Schedule, costs: CostModel) -> tuple[Config, Schedule, CostModel]:
    """Config and costs with the layer split that balances the devices' forward and backward, as the engine times
    them (``program.op_durations``: F + I + W, or F + B where a profile timed the fused backward) (never slower than
    the equal split on the slowest device)."""
    if config.model.layers_per_stage is not None:
        raise ConfigError("schedule.vocab: redistribute picks model.layers_per_stage itself, but it is given; "
                          "expected one of them (schedule.vocab naive keeps the given split)")
    def with_split(split: tuple[int, ...]) -> CostModel:
        return dataclasses.replace(costs, layers_per_stage=split, _cache={})

    back = (ActionKind.I, ActionKind.W) if schedule.splits_backward else (ActionKind.B,)

    def stage_ns(split: tuple[int, ...]) -> list[int]:
        durations = op_durations(stage_costs(with_split(split), schedule), schedule.recompute)
        return [durations[s, ActionKind.F] + sum(durations[s, k] for k in back) for s in range(schedule.num_stages)]

    split = balance_layers(stage_layers(_layers(costs), schedule.num_stages), schedule.stage_to_device, stage_ns)
    model = dataclasses.replace(config.model, layers_per_stage=split)
    return dataclasses.replace(config, model=model), schedule, with_split(split)


def _layers(costs: CostModel) -> int:
    return costs.model.layers if isinstance(costs, AnalyticCosts) else costs.layers


def _sharded(config: Config, schedule: Schedule, costs: CostModel, model: ModelSpec | None,
             method: VocabMethod) -> tuple[CostModel, dict[ActionKind, int]]:
    """The cost model with the vocabulary layers sharded over the devices, and the collectives' bytes."""
    assert method in SHARDED
    if isinstance(costs, ProfiledCosts):  # the profile times one shard's passes; its collectives are the model's
        costs = dataclasses.replace(costs, vocab_shards=schedule.num_devices, vocab_2=method is VocabMethod.VOCAB_2,
                                    _cache={}, warnings=list(costs.warnings))
        x_bytes = int(round(costs.bytes_of("layer", "boundary_bytes")))  # the last stage's output X
        return costs, collective_bytes(method, x_bytes, 2 * 4 * costs.microbatch_size * costs.seq)
    if not isinstance(costs, AnalyticCosts):  # uniform: the passes' times are costs.vocab_s and costs.vocab_t
        return costs, collective_bytes(method, 0, 0)
    m = config.model
    shards = VocabShards(method, schedule.num_devices, model, m.microbatch_size, m.precision, config.memory.runtime)
    return dataclasses.replace(costs, vocab=shards, _cache={}), shards.collective_bytes()
