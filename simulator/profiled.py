"""Costs measured on the user's own hardware: ``ProfiledCosts`` reads a ``pipescope calibrate`` profile.

Times and bytes are interpolated linearly between the measured microbatch sizes, then between the measured
sequence lengths; outside the measured range they are extrapolated linearly (proportionally when only one
point was measured) and a warning says so. Select with ``--set costs.kind=profile --set costs.profile=DIR``.
Reads the files itself (pandas), sharing only the stdlib schema module with ``calibration/``; never torch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from pipescope.simulator import profile_schema as schema
from pipescope.simulator.costs import CostKind, PerStageCache, StageCost, split_layers
from pipescope.simulator.network import Link


@dataclass(frozen=True)
class ProfiledCostsConfig:
    """``costs.kind: profile``: costs from a ``pipescope calibrate`` folder (``profile``)."""

    kind: CostKind = CostKind.PROFILE
    profile: str | None = None


def read_table(profile_dir: str | os.PathLike, meta: dict, table: str) -> pd.DataFrame:
    """Load one table the metadata names, checking it has every column the reader relies on."""
    path = schema.table_path(profile_dir, meta, table)
    frame = pd.read_parquet(path) if path.suffix == ".parquet" else pd.read_csv(path)
    schema.check_columns(frame.columns, table, str(path))
    return frame


def interp1(xs: list[float], ys: list[float], x: float) -> tuple[float, bool]:
    """Linear interpolation at ``x``; beyond the ends the nearest segment's line; one point: proportional.

    Returns:
        (value clamped at 0, whether ``x`` lay outside the measured points).
    """
    if len(xs) == 1:
        return max(0.0, ys[0] * x / xs[0]), x != xs[0]
    outside = x < xs[0] or x > xs[-1]
    j = 1 if x < xs[0] else len(xs) - 1 if x > xs[-1] else max(1, int(np.searchsorted(xs, x)))
    x0, x1, y0, y1 = xs[j - 1], xs[j], ys[j - 1], ys[j]
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0)), outside


@dataclass
class ProfiledCosts(PerStageCache):
    """A ``CostModel`` from a calibration profile (see ``calibration/profiles/README.md``).

    Per stage: its share of transformer layers (``split_layers``) times the per-layer F, I, W and recompute
    times, plus the embedding on the first stage (F, and its backward as W) and the output layer on the last
    (F, I, W). Bytes: activation (M_B) from the saved-tensor count per layer; weight-grad (M_W) from the bytes
    the deferred Linears' W still holds after I (their inputs and output grads; see the README).
    """

    timings: pd.DataFrame
    memory: pd.DataFrame
    meta: dict
    microbatch_size: int
    seq: int
    layers: int
    precision: str
    comms_fit: pd.DataFrame | None = None
    warnings: list[str] = field(default_factory=list)
    _cache: dict = field(default_factory=dict, repr=False)

    @classmethod
    def load(cls, profile_dir: str | os.PathLike, microbatch_size: int, seq: int | None = None,
             layers: int | None = None, precision: str | None = None) -> ProfiledCosts:
        """Read ``profile_dir`` (and its comms profile when there is one).

        Args:
            profile_dir: a ``pipescope calibrate --out`` folder.
            microbatch_size: samples per microbatch to predict for.
            seq: sequence length (default: the longest measured).
            layers: transformer layers of the model (default: the profiled model's).
            precision: the simulation's precision; a mismatch with the profile's is warned about.

        Raises:
            ProfileError: missing files, another schema version or a missing column.
            ValueError: a non-positive microbatch size, seq or layer count.
        """
        meta = schema.read_metadata(profile_dir)
        model = meta.get("model", {})
        seq = seq if seq is not None else int(max(meta.get("seqs") or [model.get("seq", 1)]))
        layers = layers if layers is not None else int(model.get("layers", 1))
        for key, value in (("model.microbatch_size", microbatch_size), ("model.seq", seq), ("model.layers", layers)):
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{key}: {value!r}, expected a positive integer")
        costs = cls(read_table(profile_dir, meta, "timings"), read_table(profile_dir, meta, "memory"), meta,
                    microbatch_size, seq, layers, meta.get("precision", "fp32"))
        if precision is not None and precision != costs.precision:
            costs.warnings.append(f"costs.profile: measured in {costs.precision}, the model asks for {precision}; "
                                  f"using the measured {costs.precision} costs")
        if (Path(profile_dir) / schema.COMMS_META).is_file():
            comms_meta = schema.read_metadata(profile_dir, schema.COMMS_META)
            costs.comms_fit = read_table(profile_dir, comms_meta, "comms_fit")
        return costs

    def notes(self) -> list[str]:
        """Human-readable warnings (extrapolation, precision mismatch) the simulation result prints."""
        return list(self.warnings)

    def _warn(self, message: str) -> None:
        if message not in self.warnings:
            self.warnings.append(message)

    def _lookup(self, frame: pd.DataFrame, column: str) -> float:
        """``column`` at (microbatch_size, seq): interpolate over microbatch sizes per seq, then over seqs."""
        if frame.empty:
            raise schema.ProfileError(f"costs.profile: no rows for {column!r}; expected a complete profile")
        by_seq = frame.groupby(["seq", "microbatch_size"])[column].mean()
        seqs, values = [], []
        for seq, series in by_seq.groupby(level=0):
            mbs = [float(m) for m in series.index.get_level_values(1)]
            value, outside = interp1(mbs, [float(v) for v in series.values], self.microbatch_size)
            if outside:
                self._warn(self._range_note("microbatch size", self.microbatch_size, mbs))
            seqs.append(float(seq))
            values.append(value)
        value, outside = interp1(seqs, values, self.seq)
        if outside:
            self._warn(self._range_note("sequence length", self.seq, seqs))
        return value

    @staticmethod
    def _range_note(what: str, value: int, measured: list[float]) -> str:
        if len(measured) == 1:
            return f"costs.profile: {what} {value} not measured (only {int(measured[0])}); scaled proportionally"
        return (f"costs.profile: {what} {value} outside the measured {int(measured[0])}..{int(measured[-1])}; "
                "extrapolated linearly")

    def time_ns(self, component: str, op: str) -> float:
        """Median time (ns) of ``op`` of ``component`` per microbatch at this microbatch size and seq."""
        t = self.timings
        rows = t[(t["component"] == component) & (t["op"] == op) & (t["shards"] == 1)]
        if rows.empty:
            raise schema.ProfileError(f"costs.profile: no timing for component={component!r} op={op!r}; "
                                      "expected a complete profile")
        return self._lookup(rows, "median_ns")

    def bytes_of(self, component: str, column: str) -> float:
        """A memory-table column (bytes) for ``component`` at this microbatch size and seq."""
        return self._lookup(self.memory[self.memory["component"] == component], column)

    def params_of(self, component: str) -> int:
        rows = self.memory[self.memory["component"] == component]
        return int(rows["params"].iloc[0]) if not rows.empty else 0

    def _compute(self, stage: int, num_stages: int) -> StageCost:
        n = split_layers(self.layers, num_stages)[stage]
        parts = {"layer": n}
        if stage == 0:
            parts["embedding"] = 1
        if stage == num_stages - 1:
            parts["output"] = 1
        ops = {"embedding": ("F", None, "W"), "layer": ("F", "I", "W"), "output": ("F", "I", "W")}
        f = i = w = act = m_w = 0.0
        params = 0
        for component, count in parts.items():
            fwd, inp, wgt = ops[component]
            f += count * self.time_ns(component, fwd)
            i += count * self.time_ns(component, inp) if inp else 0.0
            w += count * self.time_ns(component, wgt)
            act += count * self.bytes_of(component, "activation_bytes")
            m_w += count * self.bytes_of(component, "weight_grad_bytes")
            params += count * self.params_of(component)
        boundary = int(round(self.bytes_of("layer", "boundary_bytes")))
        return StageCost(
            forward_ns=_ns(f), input_grad_ns=_ns(i), weight_grad_ns=_ns(w),
            recompute_ns=_ns(n * self.time_ns("layer", "R")),
            boundary_bytes=boundary, activation_bytes=int(round(act)), weight_grad_bytes=int(round(m_w)),
            input_bytes=boundary, params=params,
        )

    def vocab_shard_ns(self, shards: int) -> tuple[int, int]:
        """(S, T) times of one vocabulary shard when the output layer is split ``shards`` ways."""
        t = self.timings[self.timings["component"] == schema.OUTPUT_SHARD]
        measured = sorted(int(k) for k in t["shards"].unique())
        if not measured:
            raise schema.ProfileError("costs.profile: no output_shard rows; expected calibrate --vocab-shards >= 1")
        nearest = min(measured, key=lambda k: abs(k - shards))
        if nearest != shards:
            self._warn(f"costs.profile: {shards} vocabulary shards not measured (1..{measured[-1]}); "
                       f"scaled from {nearest} shards as 1/shards")
        rows = t[t["shards"] == nearest]
        scale = nearest / shards
        return tuple(_ns(scale * self._lookup(rows[rows["op"] == op], "median_ns")) for op in ("S", "T"))

    def optimizer_ns(self, params: int, tensors: int) -> int:
        """Optimizer step time for ``params`` parameters in ``tensors`` tensors (fp32 AdamW), from a fit
        ``a + b * params + c * tensors`` over the measured groups (terms that fit negative are dropped)."""
        rows = self.timings[self.timings["op"] == "step"]
        if rows.empty:
            raise schema.ProfileError("costs.profile: no optimizer rows; expected a complete profile")
        x = np.column_stack([np.ones(len(rows)), rows["params"].to_numpy(float), rows["tensors"].to_numpy(float)])
        coef = _nonnegative_fit(x, rows["median_ns"].to_numpy(float))
        return _ns(float(coef @ np.array([1.0, params, tensors])))

    def p2p_link(self, nbytes: int) -> Link | None:
        """The comms profile's p2p fit for this size range as a link (latency, bandwidth), or None without one."""
        row = self._p2p_fit(nbytes)
        return None if row is None else Link(float(row["bandwidth"]), int(round(row["latency_ns"])))

    def _p2p_fit(self, nbytes: int) -> pd.Series | None:
        """The comms profile's p2p fit row for this size range, if a comms profile was loaded."""
        fit = self.comms_fit
        p2p = fit[fit["collective"] == "p2p"].sort_values("lo_bytes") if fit is not None else None
        if p2p is None or p2p.empty:
            return None
        below = p2p[p2p["lo_bytes"] <= nbytes]
        return below.iloc[-1] if not below.empty else p2p.iloc[0]


def _ns(value: float) -> int:
    return int(round(value))


def _nonnegative_fit(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares, refitting without any term whose coefficient comes out negative (a cost is never < 0)."""
    active = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
        if (sol >= 0).all():
            coef[active] = sol
            return coef
        active.pop(int(np.argmin(sol)))
    return coef
