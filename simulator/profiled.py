"""Costs measured on the user's own hardware: ``ProfiledCosts`` reads a ``pipescope calibrate`` profile.

Times and bytes are interpolated linearly between the measured microbatch sizes, then between the measured
sequence lengths; outside the measured range they are extrapolated linearly (proportionally when only one
point was measured; held flat where the line falls as the work grows) and a warning says so. Select with
``--set costs.kind=profile --set costs.profile=DIR``.
Reads the files itself (pandas), sharing only the stdlib schema module with ``calibration/``; never torch.

A profile is hostile input: ``load`` checks every file, every column (``profile_schema.COLUMN_RULES``) and the
costs of the whole model at the asked microbatch size and seq (an upper bound of every stage's) before any
simulation, and raises one ``ProfileError`` line naming the file, column or key, the value and what was expected.
"""

from __future__ import annotations

import numbers
import os
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import pandas as pd

from pipescope.simulator.readers import profile_schema as schema
from pipescope.simulator.readers import table_bounds
from pipescope.simulator.costs import (
    MAX_BYTES,
    MAX_OP_SECONDS,
    CostError,
    CostKind,
    PerStageCache,
    TOKEN_ID_BYTES,
    StageCost,
    seconds_to_ns,
)
from pipescope.simulator.network import Link
from pipescope.simulator.readers.profile_schema import ProfileError
from pipescope.simulator.readers.units import short_repr

# The p2p fit must time a transfer of this size (and of every size it measured, and of the stage boundary)
# within MAX_OP_SECONDS: a slower "link" is a corrupt fit, not a network.
P2P_CHECK_BYTES = 1 << 30
# (component, ops) whose times and bytes every stage cost reads.
STAGE_OPS = {schema.LAYER: ("F", "I", "W", "R"), schema.EMBEDDING: ("F", "W"), schema.OUTPUT: ("F", "I", "W")}


@dataclass(frozen=True)
class ProfiledCostsConfig:
    """``costs.kind: profile``: costs from a ``pipescope calibrate`` folder (``profile``)."""

    kind: CostKind = CostKind.PROFILE
    profile: str | None = None


def read_table(profile_dir: str | os.PathLike, meta: dict, table: str) -> pd.DataFrame:
    """Load one table the metadata names and check it (``check_table``): only the rule columns come back,
    numbers as float64 and text as str, rows in file order."""
    return _read_checked(schema.table_path(profile_dir, meta, table), table)


def _read_frame(path: Path, table: str) -> pd.DataFrame:
    """The file as a DataFrame, bounded before a row is read (``table_bounds``); any failure to parse it (pandas and
    pyarrow raise many types) is a ProfileError."""
    parquet = path.suffix == ".parquet"
    try:
        if not parquet:
            table_bounds.check_csv_header(path)
            return pd.read_csv(path, nrows=schema.MAX_TABLE_ROWS + 1)
        return _read_parquet(path, table)
    except table_bounds.TableTooBig as exc:
        raise ProfileError(f"{path}: {exc}") from None
    except ProfileError:
        raise
    except ImportError as exc:
        raise ProfileError(f"{path}: reading Parquet needs pyarrow ({schema.one_line(exc)}); "
                           "expected pip install pyarrow, or a profile written as CSV") from None
    except Exception as exc:  # noqa: BLE001 (a malformed file may raise anything from the parser)
        raise ProfileError(f"{path}: unreadable as {'Parquet' if parquet else 'CSV'} ({schema.one_line(exc)}); "
                           f"expected the {table!r} table pipescope calibrate writes") from None


def _read_parquet(path: Path, table: str) -> pd.DataFrame:
    """Only the rule columns, after the footer's bounds; text read dictionary-encoded, so that one long word in
    every row (a few bytes of Parquet) is held once rather than once a row."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rules = list(schema.COLUMN_RULES[table])
    arrow, rows = table_bounds.parquet_shape(path, schema.MAX_TABLE_UNPACKED_BYTES, rules)
    if rows > schema.MAX_TABLE_ROWS:
        raise ProfileError(f"{path}: {rows} rows; expected at most {schema.MAX_TABLE_ROWS}")
    schema.check_columns(arrow.names, table, str(path))
    nested = next((f for f in arrow if f.name in rules and pa.types.is_nested(f.type)), None)
    if nested is not None:  # its text leaves would be decoded once a row (read_dictionary takes only flat columns)
        raise ProfileError(f"{path}: column {nested.name!r} holds {short_repr(str(nested.type))}; expected a number "
                           "or a word in each cell")
    return pq.ParquetFile(path, read_dictionary=rules).read(columns=rules).to_pandas()


_MAX = f"{schema.MAX_NUMBER} (2**53)"
_EXPECTED = {
    "count": f"a whole number from 0 to {_MAX}",
    "positive": f"a whole number from 1 to {_MAX}",
    "point": f"a measured size, a whole number from 1 to {_MAX}",
    "ns": f"a time in ns from 0 to {MAX_OP_SECONDS * 1e9:g} (MAX_OP_SECONDS = {MAX_OP_SECONDS:g} s)",
    "duration": f"a time in ns above 0 and at most {MAX_OP_SECONDS * 1e9:g} (MAX_OP_SECONDS = {MAX_OP_SECONDS:g} s)",
    "bytes": f"a number of bytes from 0 to {_MAX}",
    "bytes?": f"a number of bytes from 0 to {_MAX}, or NaN (not measured)",
    "rate": f"a bandwidth in bytes/s above 0 and at most {_MAX}",
}


def check_table(frame: pd.DataFrame, table: str, where: str) -> pd.DataFrame:
    """Check every row against ``profile_schema.COLUMN_RULES[table]``; ProfileError names the first bad cell.

    Returns:
        the rule columns only, with a fresh index: numbers as float64, text as str.
    """
    schema.check_columns(frame.columns, table, where)
    if len(frame) > schema.MAX_TABLE_ROWS:
        raise ProfileError(f"{where}: more than {schema.MAX_TABLE_ROWS} rows; expected at most that many")
    raw = {column: _cells(frame[column]) for column in schema.COLUMN_RULES[table]}
    # Optimizer rows of the timings table measure no (microbatch, seq) point and store 0 there.
    unmeasured = np.array([v == schema.OPTIMIZER for v in raw.get("component", [])], dtype=bool) \
        if table == "timings" else np.zeros(len(frame), dtype=bool)
    checked = {}
    for column, rule in schema.COLUMN_RULES[table].items():
        values = raw[column]
        if isinstance(rule, tuple):
            ok = np.array([isinstance(v, str) and v in rule for v in values], dtype=bool)
            expected, checked[column] = f"one of {', '.join(rule)}", values
        else:
            number = _as_floats(frame[column], values)
            ok = _within(number, rule, unmeasured)
            expected, checked[column] = _EXPECTED[rule], number
        bad = np.flatnonzero(~ok)
        if bad.size:
            row = int(bad[0])
            raise ProfileError(f"{where}: column {column!r} row {row + 1}: {short_repr(values[row])}; "
                               f"expected {expected}")
    return pd.DataFrame(checked)


def _cells(column: pd.Series) -> np.ndarray:
    """A column's cells as Python objects. A categorical's (a dictionary-encoded Parquet column) repeats share one
    object: to_numpy would copy its word into every row, 37 rows of a 50 MiB word into 1.9 GB."""
    if not isinstance(column.dtype, pd.CategoricalDtype):
        return column.to_numpy(dtype=object)
    words = np.append(column.cat.categories.to_numpy(dtype=object), np.nan)  # code -1 (a missing cell) picks NaN
    return words[column.cat.codes.to_numpy()]


def _as_floats(column: pd.Series, values: np.ndarray) -> np.ndarray:
    """A column as float64: numeric dtypes as they are, elsewhere each real number (not a bool) converted and
    anything else (text, None, bool) NaN, which the rules then refuse."""
    dtype = column.dtype
    if (pd.api.types.is_numeric_dtype(dtype) and not pd.api.types.is_bool_dtype(dtype)
            and not pd.api.types.is_complex_dtype(dtype)):
        return column.to_numpy(dtype=np.float64, na_value=np.nan)
    return np.array([_real(v) for v in values], dtype=np.float64)


def _real(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return float("nan")
    try:
        return float(value)
    except OverflowError:  # an integer beyond float64, e.g. 10**400 in a CSV cell
        return float("inf")


def _within(x: np.ndarray, rule: str, unmeasured: np.ndarray) -> np.ndarray:
    """Which entries of ``x`` satisfy ``rule`` (see profile_schema.COLUMN_RULES)."""
    with np.errstate(invalid="ignore"):
        finite = np.isfinite(x) & (x <= schema.MAX_NUMBER)
        whole = finite & (x == np.floor(x))
        if rule == "count":
            return whole & (x >= 0)
        if rule == "positive":
            return whole & (x >= 1)
        if rule == "point":
            return whole & ((x >= 1) | (unmeasured & (x == 0)))
        if rule == "ns":
            return finite & (x >= 0) & (x <= MAX_OP_SECONDS * 1e9)
        if rule == "duration":
            return finite & (x > 0) & (x <= MAX_OP_SECONDS * 1e9)
        if rule == "bytes":
            return finite & (x >= 0)
        if rule == "bytes?":
            return (finite & (x >= 0)) | np.isnan(x)
        if rule == "rate":
            return finite & (x > 0)
    raise AssertionError(f"unknown column rule {rule!r}")


def interp1(xs: list[float], ys: list[float], x: float) -> tuple[float, str]:
    """Linear interpolation at ``x``; beyond the ends the nearest segment's line, with two guards, since more work
    never makes an op cheaper or a tensor smaller: a line that falls as the work grows (measurement noise: a 55 us
    op measured at 62 us one size down) is held flat at the nearest measurement, and a line that reaches 0 below the
    measured sizes is scaled in proportion to the nearest one, as a single point is. Followed, both made ops free.

    Returns:
        (value, how): ``how`` is "" inside the measured points, else "linear", "flat" or "proportional".
    """
    if len(xs) == 1:
        return ys[0] * x / xs[0], "" if x == xs[0] else "proportional"
    if xs[0] <= x <= xs[-1]:
        j = max(1, int(np.searchsorted(xs, x)))
        return ys[j - 1] + (ys[j] - ys[j - 1]) * (x - xs[j - 1]) / (xs[j] - xs[j - 1]), ""
    j, near = (1, 0) if x < xs[0] else (len(xs) - 1, len(xs) - 1)
    slope = (ys[j] - ys[j - 1]) / (xs[j] - xs[j - 1])
    if slope < 0:
        return ys[near], "flat"
    value = ys[near] + slope * (x - xs[near])
    if value > 0 or ys[near] == 0:  # a measured 0 stays 0 (never below)
        return max(0.0, value), "linear"
    return ys[near] * x / xs[near], "proportional"


@dataclass
class ProfiledCosts(PerStageCache):
    """A ``CostModel`` from a calibration profile (see ``calibration/profiles/README.md``).

    Per stage: its share of transformer layers (``layers_per_stage``, else the equal split; ``models.stage_layers``)
    times the per-layer F, I, W and recompute
    times, plus the embedding on the first stage (F, and its backward as W) and the output layer on the last
    (F, I, W). Bytes: activation (M_B) from the saved-tensor count per layer; weight-grad (M_W) from the bytes
    the deferred Linears' W still holds after I (their inputs and output grads; see the README). The optimizer
    step: the AdamW fit (``optimizer_ns``) at the stage's parameters (under ZeRO, a replica's shard of them) and
    parameter tensors.
    """

    timings: pd.DataFrame
    memory: pd.DataFrame
    meta: dict
    microbatch_size: int
    seq: int
    layers: int
    precision: str
    comms_fit: pd.DataFrame | None = None
    layers_per_stage: tuple[int, ...] | None = None  # None: the equal split
    vocab_shards: int = 0  # vocabulary parallelism over this many devices (0: naive, the output on the last stage)
    vocab_2: bool = False  # vocab-2's passes (S2, T2) rather than vocab-1's (S, T)
    optimizer_shards: int = 1  # ZeRO 1-2: the step runs on 1 / shards of the stage's parameters (the fit's point)
    # Per stage, op times (ns by kind: F, B, I, W, OPT) measured stage by stage in the executor, which replace the
    # profile's (``validate --op-times stages``, executor/stage_timing.py); bytes stay the profile's
    op_times: tuple[dict[str, int], ...] | None = None
    warnings: list[str] = field(default_factory=list)
    files: dict[str, str] = field(default_factory=dict)  # table name -> the file it was read from (for errors)
    _cache: dict = field(default_factory=dict, repr=False)

    @classmethod
    def load(cls, profile_dir: str | os.PathLike, microbatch_size: int, seq: int | None = None,
             layers: int | None = None, precision: str | None = None,
             layers_per_stage: Sequence[int] | None = None, optimizer_shards: int = 1) -> ProfiledCosts:
        """Read and check ``profile_dir`` (and its comms profile when there is one), before any simulation.

        Args:
            profile_dir: a ``pipescope calibrate --out`` folder.
            microbatch_size: samples per microbatch to predict for.
            seq: sequence length (default: the longest measured).
            layers: transformer layers of the model (default: the profiled model's).
            precision: the simulation's precision; a mismatch with the profile's is warned about.
            layers_per_stage: transformer layers of each stage (default: the equal split); checked against the
                stage count when a stage's cost is asked for (``models.stage_layers``).
            optimizer_shards: the replicas a ZeRO stage of 1 or 2 shards the optimizer's step over.

        Raises:
            ProfileError: a missing, unreadable or malformed file, another schema version, a missing column, a
                bad cell, a missing (component, op), or costs beyond the bounds at this size (see ``check``).
            ValueError: a microbatch size, seq or layer count that is not an integer from 1 to 2**53.
        """
        for key, value in (("model.microbatch_size", microbatch_size), ("model.seq", seq), ("model.layers", layers)):
            if value is not None and not schema.is_count(value):
                raise ValueError(f"{key}: got {short_repr(value)}, expected a positive integer "
                                 f"(at most {schema.MAX_NUMBER})")
        meta = schema.read_metadata(profile_dir)
        model = meta.get("model", {})
        seq = seq if seq is not None else max(meta.get("seqs") or [model.get("seq", 1)])
        layers = layers if layers is not None else model.get("layers", 1)
        paths = {table: schema.table_path(profile_dir, meta, table) for table in ("timings", "memory")}
        costs = cls(_read_checked(paths["timings"], "timings"), _read_checked(paths["memory"], "memory"), meta,
                    microbatch_size, seq, layers, meta.get("precision", "fp32"),
                    layers_per_stage=None if layers_per_stage is None else tuple(layers_per_stage),
                    optimizer_shards=optimizer_shards, files={table: str(path) for table, path in paths.items()})
        if precision is not None and precision != costs.precision:
            costs.warnings.append(f"costs.profile: measured in {costs.precision}, the model asks for {precision}; "
                                  f"using the measured {costs.precision} costs")
        costs.warnings += _noisy_note(meta)
        if (Path(profile_dir) / schema.COMMS_META).is_file():
            costs.comms_fit, costs.files["comms_fit"] = load_comms_fit(profile_dir)
        costs.check()
        return costs

    def check(self) -> None:
        """Refuse now what a simulation would otherwise fail on, or get silently wrong.

        Every (component, op) a stage reads must be measured. The whole model on one stage, whose costs bound
        every stage's of any split, must take at most ``MAX_OP_SECONDS`` per op and hold at most ``MAX_BYTES``
        (both from simulator/costs.py). Each p2p fit must move ``P2P_CHECK_BYTES``, its largest measured size and
        the stage boundary within ``MAX_OP_SECONDS``. A positive time under 0.5 ns is kept; ``seconds_to_ns``
        makes it 1 ns, the clock's resolution.
        """
        t, memory = self.timings, self.memory
        self._check_unique()
        measured = {int(seq) for seq in t.loc[t["component"] == "layer", "seq"]}
        missing = [seq for seq in self.meta.get("seqs", []) if seq not in measured]
        if missing:
            raise ProfileError(f"{self.files['timings']}: no layer row with seq={missing[0]}, which profile.json's "
                               f"seqs lists; expected the sequence lengths the tables hold ({sorted(measured)})")
        for component, ops in STAGE_OPS.items():
            for op in ops:
                if not ((t["component"] == component) & (t["op"] == op) & (t["shards"] == 1)).any():
                    raise ProfileError(f"{self.files['timings']}: no row with component={component!r} op={op!r} "
                                       "shards=1; expected a complete profile")
            if not (memory["component"] == component).any():
                raise ProfileError(f"{self.files['memory']}: no row with component={component!r}; "
                                   "expected a complete profile")
        whole = self._stage(self.layers, 0, 1)
        for name in ("activation_bytes", "weight_grad_bytes", "boundary_bytes", "params"):
            value = getattr(whole, name)
            if value > MAX_BYTES:
                raise ProfileError(f"{self.files['memory']}: {name} of the whole model would be {value} "
                                   f"{self._point()}; expected at most {MAX_BYTES} (costs.MAX_BYTES)")
        fit = self.comms_fit
        if fit is None:
            return
        for row in fit[fit["collective"] == "p2p"].itertuples():
            nbytes = max(int(row.hi_bytes), whole.boundary_bytes, P2P_CHECK_BYTES)
            seconds = row.latency_ns / 1e9 + nbytes / row.bandwidth
            try:
                seconds_to_ns(seconds)
            except CostError:
                raise ProfileError(f"{self.files['comms_fit']}: row {row.Index + 1}: p2p latency_ns={row.latency_ns:g}"
                                   f", bandwidth={row.bandwidth:g} would move {nbytes} bytes in {seconds:g} s; "
                                   f"expected at most {MAX_OP_SECONDS:g} s per transfer") from None

    def _check_unique(self) -> None:
        """One row per point a lookup reads: a second one would be averaged with the first, or fitted as a second
        measurement of it, silently (whatever else the rows say, such as their params)."""
        t = self.timings
        step = (t["op"] == "step").to_numpy()
        for table, frame, key in (("timings", t[~step], LOOKUP_KEY), ("timings", t[step], STEP_KEY),
                                  ("memory", self.memory, MEMORY_KEY)):
            twice = frame.duplicated(list(key))
            if twice.any():
                row = twice.idxmax()  # labels are file rows from 0 (check_table's fresh index)
                first = (frame[list(key)] == frame.loc[row, list(key)]).all(axis=1).idxmax()
                point = ", ".join(f"{k}={frame.at[row, k]:g}" if pd.api.types.is_float_dtype(frame[k]) else
                                  f"{k}={frame.at[row, k]}" for k in key)
                raise ProfileError(f"{self.files[table]}: row {row + 1}: {point} is measured twice (also row "
                                   f"{first + 1}); expected one row per point")
        self._check_one_count()

    def _check_one_count(self) -> None:
        """One params and one tensors count per component: params_of and tensors_of read its first memory row."""
        memory = self.memory
        for column in ("params", "tensors"):
            first = memory.groupby("component")[column].transform("first")
            other = memory[column] != first
            if other.any():
                row = other.idxmax()
                component = memory.at[row, "component"]
                first_row = (memory["component"] == component).idxmax()
                raise ProfileError(f"{self.files['memory']}: row {row + 1}: component={component} {column}="
                                   f"{memory.at[row, column]:g}, but row {first_row + 1} says {first.at[row]:g}; "
                                   f"expected one {column} count per component")

    def notes(self) -> list[str]:
        """Human-readable warnings (extrapolation, precision mismatch) the simulation result prints."""
        return list(self.warnings)

    def kernel_report(self, num_stages: int) -> list[dict]:
        return []  # a profile times whole components, not their kernels

    def _warn(self, message: str) -> None:
        if message not in self.warnings:
            self.warnings.append(message)

    def _point(self) -> str:
        return f"({self.layers} layers, microbatch size {self.microbatch_size}, seq {self.seq})"

    def _ns(self, value: float, what: str) -> int:
        """``value`` ns as an integer, bounded by ``MAX_OP_SECONDS`` (``costs.seconds_to_ns``)."""
        try:
            return seconds_to_ns(value / 1e9)
        except CostError:
            raise ProfileError(f"{self.files.get('timings', 'costs.profile')}: {what} would take {value / 1e9:g} s "
                               f"{self._point()}; expected at most {MAX_OP_SECONDS:g} s per op") from None

    def _lookup(self, frame: pd.DataFrame, column: str) -> float:
        """``column`` at (microbatch_size, seq): interpolate over microbatch sizes per seq, then over seqs."""
        if frame.empty:
            raise ProfileError(f"{self._file_of(column)}: no rows for {column!r}; expected a complete profile")
        by_seq = frame.groupby(["seq", "microbatch_size"])[column].mean()  # of one row (_check_unique)
        what = self._file_of(column) + ": " + " ".join(
            f"{k}={frame[k].iloc[0]}" for k in ("component", "op") if k in frame) + f" {column}"
        seqs, values = [], []
        for seq, series in by_seq.groupby(level=0):
            mbs = [float(m) for m in series.index.get_level_values(1)]
            values.append(self._interp(f"{what} at seq {int(seq)}", "microbatch size", self.microbatch_size, mbs,
                                       [float(v) for v in series.values]))
            seqs.append(float(seq))
        return self._interp(f"{what} at microbatch size {self.microbatch_size}", "sequence length", self.seq, seqs,
                            values)

    def _interp(self, what: str, axis: str, x: int, xs: list[float], ys: list[float]) -> float:
        """``interp1`` at ``x`` on ``axis``, with a warning outside the measured ``xs`` saying how it extrapolated
        (naming the op where its measured line falls or reaches 0: a noisy row the user may calibrate again)."""
        value, how = interp1(xs, ys, x)
        if how in ("flat", "proportional") and len(xs) > 1:
            points = ", ".join(f"{int(a)}: {b:g}" for a, b in zip(xs, ys))
            done = {"flat": "falls as the work grows, so the nearest measurement is held",
                    "proportional": "reaches 0 there, so it is scaled in proportion to the nearest measurement"}[how]
            self._warn(f"{what} at {axis} {x}: the line through the measured points ({points}) {done}; calibrate at "
                       f"{axis} {x} to measure it")
        elif how:
            self._warn(self._range_note(axis, x, xs))
        return value

    def _file_of(self, column: str) -> str:
        """The file a column's lookup reads (for errors)."""
        return self.files.get("memory" if column in schema.MEMORY_COLUMNS else "timings", "costs.profile")

    @staticmethod
    def _range_note(what: str, value: int, measured: list[float]) -> str:
        if len(measured) == 1:
            return f"costs.profile: {what} {value} not measured (only {int(measured[0])}); scaled proportionally"
        return (f"costs.profile: {what} {value} outside the measured {int(measured[0])}..{int(measured[-1])}; "
                "extrapolated linearly")

    def time_ns(self, component: str, op: str) -> float:
        """Median time (ns) of ``op`` of ``component`` per microbatch at this microbatch size and seq."""
        median = self._median_ns(component, op)
        if median is None:
            raise ProfileError(f"{self.files.get('timings', 'costs.profile')}: no timing for component="
                               f"{component!r} op={op!r}; expected a complete profile")
        return median

    def _median_ns(self, component: str, op: str) -> float | None:
        """``time_ns``, or None where the profile did not time it (a fused B may be missing: then B = I + W)."""
        t = self.timings
        rows = t[(t["component"] == component) & (t["op"] == op) & (t["shards"] == 1)]
        return None if rows.empty else self._lookup(rows, "median_ns")

    def bytes_of(self, component: str, column: str) -> float:
        """A memory-table column (bytes) for ``component`` at this microbatch size and seq."""
        return self._lookup(self.memory[self.memory["component"] == component], column)

    def params_of(self, component: str) -> int:
        rows = self.memory[self.memory["component"] == component]
        return int(rows["params"].iloc[0]) if not rows.empty else 0

    def tensors_of(self, component: str) -> int:
        """Parameter tensors of one ``component`` (the optimizer fit's second term)."""
        rows = self.memory[self.memory["component"] == component]
        return int(rows["tensors"].iloc[0]) if not rows.empty else 0

    def _compute(self, stage: int, num_stages: int) -> StageCost:
        cost = self._stage(self._layers_of(stage, num_stages, self.layers), stage, num_stages)
        if self.op_times is None:
            return cost
        if len(self.op_times) != num_stages:
            raise ProfileError(f"op_times: got {len(self.op_times)} stages' times, expected {num_stages} (the stages "
                               "of the schedule they were measured on)")
        return with_op_times(cost, self.op_times[stage])

    def _stage(self, n: int, stage: int, num_stages: int) -> StageCost:
        """Costs of ``stage`` of ``num_stages`` holding ``n`` transformer layers."""
        parts = {"layer": n}
        if stage == 0:
            parts["embedding"] = 1
        if stage == num_stages - 1 and not self.vocab_shards:
            parts["output"] = 1
        ops = {"embedding": ("F", None, "W"), "layer": ("F", "I", "W"), "output": ("F", "I", "W")}
        fused_op = {"embedding": "W", "layer": "B", "output": "B"}  # the embedding's whole backward is its W
        f = i = w = act = m_w = 0.0
        fused: float | None = 0.0
        params = tensors = 0
        for component, count in parts.items():
            fwd, inp, wgt = ops[component]
            f += count * self.time_ns(component, fwd)
            i += count * self.time_ns(component, inp) if inp else 0.0
            w += count * self.time_ns(component, wgt)
            measured = self._median_ns(component, fused_op[component])
            fused = None if fused is None or measured is None else fused + count * measured
            act += count * self.bytes_of(component, "activation_bytes")
            m_w += count * self.bytes_of(component, "weight_grad_bytes")
            params += count * self.params_of(component)
            tensors += count * self.tensors_of(component)
        params += self._vocab_params(stage)
        boundary = int(round(self.bytes_of("layer", "boundary_bytes")))
        where = f"stage {stage} of {num_stages}"
        return StageCost(
            forward_ns=self._ns(f, f"the forward of {where}"),
            input_grad_ns=self._ns(i, f"the input gradient of {where}"),
            weight_grad_ns=self._ns(w, f"the weight gradient of {where}"),
            backward_ns=None if fused is None else self._ns(fused, f"the backward of {where}"),
            recompute_ns=self._ns(n * self.time_ns("layer", "R"), f"the recompute of {where}"),
            boundary_bytes=boundary, activation_bytes=int(round(act)), weight_grad_bytes=int(round(m_w)),
            input_bytes=boundary if stage else self.microbatch_size * self.seq * TOKEN_ID_BYTES, params=params,
            optimizer_ns=self.optimizer_ns(-(-params // self.optimizer_shards), tensors), param_tensors=tensors,
            **self._vocab_part(stage),
        )

    def _vocab_params(self, stage: int) -> int:
        """Under vocabulary parallelism, parameters moved onto the stage: both vocabulary layers' split equally over
        the devices' first stages, the embedding's taken off stage 0 (whose lookup time stays there)."""
        if not self.vocab_shards:
            return 0
        shard = (self.params_of(schema.EMBEDDING) + self.params_of(schema.OUTPUT)) // self.vocab_shards
        return (shard if stage < self.vocab_shards else 0) - (self.params_of(schema.EMBEDDING) if stage == 0 else 0)

    def _vocab_part(self, stage: int) -> dict[str, int]:
        """Under vocabulary parallelism, the S and T passes and stash of the stage's device shard, on the device's
        first stage (docs/costs.md, "Vocabulary passes")."""
        if not self.vocab_shards or stage >= self.vocab_shards:
            return {}
        s, t = self.vocab_passes_ns(self.vocab_shards, self.vocab_2)
        # the shard's part of the output layer's stash, and its copy of the broadcast input X (the stage boundary)
        stash = self.bytes_of(schema.OUTPUT, "activation_bytes") / self.vocab_shards + self.bytes_of("layer",
                                                                                                    "boundary_bytes")
        return {"vocab_s_ns": s, "vocab_t_ns": t, "vocab_bytes": int(round(stash))}

    def vocab_passes_ns(self, shards: int, vocab_2: bool) -> tuple[int, int]:
        """(S, T) of one shard: the profile's S and T (vocab-1), or its S2 and T2 (vocab-2). Without S2/T2 rows
        they are estimated as S + T/2 and T/2: vocab-2 moves T's grad-X product (half of T's matmul FLOPs) into S,
        and a note says so."""
        if not vocab_2:
            return self.vocab_shard_ns(shards)
        t = self.timings
        if ((t["component"] == schema.OUTPUT_SHARD) & t["op"].isin(["S2", "T2"])).any():
            return self.vocab_shard_ns(shards, ("S2", "T2"))
        s, full_t = self.vocab_shard_ns(shards)
        self._warn("costs.profile: no output_shard S2/T2 rows (the vocab-2 passes); estimated S2 = S + T/2 and "
                   "T2 = T/2 from the S and T rows")
        return s + full_t // 2, full_t - full_t // 2

    def vocab_shard_ns(self, shards: int, ops: tuple[str, str] = ("S", "T")) -> tuple[int, int]:
        """(S, T) times of one vocabulary shard when the output layer is split ``shards`` ways (``ops``: the rows
        that time them)."""
        t = self.timings[self.timings["component"] == schema.OUTPUT_SHARD]
        measured = sorted(int(k) for k in t["shards"].unique())
        if not measured:
            raise ProfileError(f"{self.files.get('timings', 'costs.profile')}: no output_shard rows; "
                               "expected calibrate --vocab-shards >= 1")
        nearest = min(measured, key=lambda k: abs(k - shards))
        if nearest != shards:
            self._warn(f"costs.profile: {shards} vocabulary shards not measured (1..{measured[-1]}); "
                       f"scaled from {nearest} shards as 1/shards")
        rows = t[t["shards"] == nearest]
        scale = nearest / shards
        return tuple(self._ns(scale * self._lookup(rows[rows["op"] == op], "median_ns"), f"vocabulary shard {op}")
                     for op in ops)

    def optimizer_ns(self, params: int, tensors: int) -> int:
        """Optimizer step time for ``params`` parameters in ``tensors`` tensors (fp32 AdamW), from a fit
        ``a + b * params + c * tensors`` over the measured groups (terms that fit negative are dropped)."""
        rows = self.timings[self.timings["op"] == "step"]
        if rows.empty:
            raise ProfileError(f"{self.files.get('timings', 'costs.profile')}: no optimizer rows; "
                               "expected a complete profile")
        x = np.column_stack([np.ones(len(rows)), rows["params"].to_numpy(float), rows["tensors"].to_numpy(float)])
        coef = _nonnegative_fit(x, rows["median_ns"].to_numpy(float))
        return self._ns(float(coef @ np.array([1.0, params, tensors])), "the optimizer step")

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


OP_TIME_FIELDS = {"F": "forward_ns", "I": "input_grad_ns", "W": "weight_grad_ns", "B": "backward_ns",
                  "OPT": "optimizer_ns"}


def with_op_times(cost: StageCost, times: dict[str, int]) -> StageCost:
    """``cost`` with the measured op times ``times`` (ns by kind). A measured backward already ran the recompute,
    so the recompute's own time goes."""
    measured = {OP_TIME_FIELDS[kind]: ns for kind, ns in times.items() if kind in OP_TIME_FIELDS}
    return replace(cost, **measured, recompute_ns=0)


def _noisy_note(meta: dict) -> list[str]:
    """A warning when calibration left rows noisy (only their count is read, so a hostile list cannot break it)."""
    noisy = meta.get("noisy_rows")
    if not isinstance(noisy, list) or not noisy:
        return []
    timing = meta.get("timing") if isinstance(meta.get("timing"), dict) else {}
    return [f"costs.profile: {len(noisy)} timing rows stayed noisy when calibrated (p90/median above "
            f"{short_repr(timing.get('max_spread'))}, listed under noisy_rows in profile.json); their times may be "
            f"too high: re-calibrate on a quiet machine"]


def load_comms_fit(profile_dir: str | os.PathLike) -> tuple[pd.DataFrame, str]:
    """The checked ``comms_fit`` table of a ``pipescope calibrate-comms`` folder, and the file it came from.

    Raises:
        ProfileError: a missing or malformed comms.json or table.
    """
    comms_meta = schema.read_metadata(profile_dir, schema.COMMS_META)
    path = schema.table_path(profile_dir, comms_meta, "comms_fit")
    return _read_checked(path, "comms_fit"), str(path)


# The columns a lookup reads a measured point by (``_lookup``, ``bytes_of``): rows that agree on them are one point,
# whatever their other columns say. The optimizer fit reads every "step" row as a point of its parameters and tensors.
LOOKUP_KEY = ("component", "op", "microbatch_size", "seq", "shards")
STEP_KEY = ("op", "params", "tensors")
MEMORY_KEY = ("component", "microbatch_size", "seq")


def _read_checked(path: Path, table: str) -> pd.DataFrame:
    return check_table(_read_frame(path, table), table, str(path))


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
