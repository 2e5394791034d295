"""`pipescope plot` and the figure functions: every kind renders to PNG and SVG from a real run's files, the figures
hold the lanes, lines and panels they should, and bad input is one line with exit 2."""

from __future__ import annotations

import gzip
import json
import re
import struct
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import matplotlib
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import pytest

import pipescope
from pipescope.experiments import plots_inputs
from pipescope.experiments.palette import schedule_color
from pipescope.experiments.plots import (COLORS, ODD_CHUNK_COLORS, bubble_figure, gantt_figure, memory_figure,
                                         run_data, save_figure, throughput_figure, validate_figure, vocab_figure)
from pipescope.experiments.plots_inputs import read_sweep, run_from_timeline, run_from_trace
from pipescope.experiments.plots_style import byte_unit
from pipescope.experiments.tables import write_timeline
from pipescope.simulator.check import unit_steps
from pipescope.simulator.ir import ActionKind
from pipescope.simulator.trace import write_trace

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run(*sets: str) -> pipescope.SimResult:
    return pipescope.run(pipescope.load_config(None, list(sets)))


def uniform(name: str, p: int, m: int, *sets: str) -> pipescope.SimResult:
    return run("costs.kind=uniform", f"schedule.name={name}", f"schedule.stages={p}", f"schedule.microbatches={m}",
               *sets)


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) from a PNG's header; fails unless the file is a PNG."""
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    return struct.unpack(">II", data[16:24])


def assert_svg(path: Path) -> None:
    root = ElementTree.parse(path).getroot()
    assert root.tag.endswith("svg") and path.stat().st_size > 10_000


@pytest.fixture(scope="module")
def twobw() -> pipescope.SimResult:
    """2BW over three iterations with analytic costs: transfers, links, memory and optimizer steps."""
    return run("schedule.name=2bw", "schedule.stages=4", "schedule.microbatches=4")


@pytest.fixture(scope="module")
def files(twobw: pipescope.SimResult, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The files the plots read, each written by the code that writes it for users."""
    folder = tmp_path_factory.mktemp("plots")
    paths = {name: folder / name for name in ("t.json.gz", "t.parquet", "t.csv", "sweep.parquet", "sweep.csv",
                                              "validate.json", "measured.parquet", "summary.json")}
    write_trace(twobw, str(paths["t.json.gz"]))
    write_timeline(twobw, str(paths["t.parquet"]))
    write_timeline(twobw, str(paths["t.csv"]))
    paths["summary.json"].write_text(json.dumps(twobw.summary()))
    sweep = sweep_rows()
    sweep.to_parquet(paths["sweep.parquet"], index=False)
    sweep.to_csv(paths["sweep.csv"], index=False)
    predicted, measured = run("schedule.stages=2", "schedule.microbatches=4", "model.preset=tiny"), \
        run("schedule.stages=2", "schedule.microbatches=4", "model.preset=tiny", "faults.jitter=0.2", "seed=3")
    write_timeline(measured, str(paths["measured.parquet"]))
    paths["validate.json"].write_text(json.dumps(validate_report(predicted, measured)))
    return paths


def validate_report(predicted: pipescope.SimResult, measured: pipescope.SimResult) -> dict:
    """The fields of a `pipescope validate --json` report (experiments/validate_cmd.py) that `plot overlay` reads,
    from two runs: a jittered run stands in for the measured one, which needs torch and minutes."""
    devices = [{"device": p.device, "predicted_busy_s": p.busy_s, "measured_busy_s": m.busy_s,
                "busy_error": p.busy_s / m.busy_s - 1, "predicted_peak_memory_bytes": p.peak_memory_bytes,
                "measured_peak_memory_bytes": m.peak_memory_bytes}
               for p, m in zip(predicted.devices, measured.devices)]
    return {"schedule": "1f1b", "stages": 2, "microbatches": 4, "iterations_measured": 1,
            "predicted_iteration_time_s": predicted.iteration_time_s,
            "measured_iteration_time_s": measured.iteration_time_s,
            "iteration_time_error": predicted.iteration_time_s / measured.iteration_time_s - 1, "per_device": devices}


def sweep_rows() -> pd.DataFrame:
    """A sweep's table as `pipescope sweep` writes it (dotted config columns, metrics with units), from real runs;
    one failed run, recorded without metrics."""
    rows = []
    for name in ("gpipe", "1f1b", "zb-h1"):
        for m in (4, 8, 16):
            for p, w in ((2, 1), (4, 1), (2, 2), (4, 2)):
                r = uniform(name, p, m, f"cluster.data_parallel={w}")
                rows.append({"schedule.name": name, "schedule.microbatches": m, "schedule.stages": p,
                             "cluster.data_parallel": w, "iteration_time_s": r.iteration_time_s,
                             "throughput_samples_per_s": r.throughput_samples_per_s, "bubble_rate": r.bubble_rate,
                             "peak_memory_bytes": r.peak_memory_bytes, "mfu": r.mfu, "status": "ok"})
    rows.append({"schedule.name": "zb-v", "schedule.microbatches": 4, "schedule.stages": 3, "status": "error"})
    return pd.DataFrame(rows)


def legend(ax: plt.Axes) -> list[str]:
    return [t.get_text() for t in ax.get_legend().get_texts()]


def dashed(ax: plt.Axes) -> int:
    return sum(line.get_linestyle() == "--" for line in ax.lines)


def test_gantt_time_lanes_links_memory_and_iterations(twobw: pipescope.SimResult) -> None:
    """Each device gets a compute row and its send and receive lanes; links and memory panels below; a dashed line
    where each of the first two of three iterations ends, on every panel; F, B, OPT and both transfers in the
    legend."""
    fig = gantt_figure(twobw, comm_lanes=True, memory=True)
    try:
        devices, links, memory = fig.axes[:3]
        rows = [t.get_text() for t in devices.get_yticklabels()]
        assert rows == [label for d in range(4) for label in (f"device {d}", "send", "recv")]
        assert [dashed(ax) for ax in (devices, links, memory)] == [2, 2, 2]
        assert {"forward", "backward (I+W)", "optimizer step", "activation transfer", "gradient transfer",
                "iteration ends"} <= set(legend(devices))
        assert legend(memory) == [f"device {d}" for d in range(4)]
        spans = [c for c in links.collections if c.get_paths()]  # a bar per busy span, with a hairline edge
        assert spans and all(c.get_linewidth()[0] > 0 for c in spans)  # (a span under a pixel would vanish)
        assert memory.get_ylabel() == "memory (GiB)" and devices.get_xlabel() == "" and "time (ms)" in \
            memory.get_xlabel()
    finally:
        plt.close(fig)


def test_optimizer_step_has_its_own_colour(twobw: pipescope.SimResult) -> None:
    """OPT is drawn in a colour no other kind has, in even and odd chunks."""
    assert len(set(COLORS.values())) == len(COLORS) and len(set(ODD_CHUNK_COLORS.values())) == len(COLORS)
    fig = gantt_figure(twobw)
    try:
        faces = {tuple(np.round(c.get_facecolor()[0][:3], 3)) for c in fig.axes[0].collections}
        opt = tuple(np.round(plt.matplotlib.colors.to_rgb(COLORS[ActionKind.OPT]), 3))
        assert opt in faces
    finally:
        plt.close(fig)


@pytest.mark.parametrize(("name", "p", "m"), [("1f1b", 4, 8), ("zb-v", 4, 8), ("interleaved", 4, 8), ("2bw", 3, 4)])
def test_gantt_steps_is_the_unit_time_replay(name: str, p: int, m: int) -> None:
    """In steps mode every op is one cell wide and the chart ends at the engine's unit-time step count."""
    result = uniform(name, p, m)
    fig = gantt_figure(result, mode="steps")
    try:
        ax = fig.axes[0]
        cells = [path.vertices[:, 0] for c in ax.collections for path in c.get_paths()]
        assert all(x.max() - x.min() == 1 for x in cells)
        assert len(cells) == result.schedule.num_compute_ops()
        assert max(x.max() for x in cells) == unit_steps(result.schedule)
        assert ax.get_xlabel().startswith("step") and len(fig.axes) == 1
        # the title counts the steps drawn; the run's iteration time and bubble are its times', not the steps'
        title = ax.get_title()
        assert title.endswith(f"  {unit_steps(result.schedule)} unit steps") and "iteration" not in title
    finally:
        plt.close(fig)


def test_trace_reads_back_the_run(twobw: pipescope.SimResult, files: dict[str, Path]) -> None:
    """The trace gives back the run's rows, lanes, memory curves and iteration size (from its OPT steps)."""
    data, direct = run_from_trace(json.loads(gzip.decompress(files["t.json.gz"].read_bytes())), "t", None), \
        run_data(twobw)
    columns = ["device", "lane", "kind", "stage", "microbatch", "start_ns", "end_ns"]
    key = columns[:1] + columns[3:]
    mine = data.ops[columns].sort_values(key).reset_index(drop=True)
    theirs = direct.ops[columns].sort_values(key).reset_index(drop=True).astype({"kind": str})
    pd.testing.assert_frame_equal(mine, theirs, check_dtype=False)
    assert (data.pipeline_devices, data.chunks, data.microbatches) == (4, 1, 4)
    for (t1, b1), (t2, b2) in zip(data.memory, direct.memory):
        assert np.array_equal(t1, t2) and np.array_equal(b1, b2)
    assert list(data.links) == list(direct.links)


def test_cli_gantt_png_svg_pdf(cli, files: dict[str, Path], tmp_path: Path) -> None:
    """A trace, a Parquet and a CSV timeline render to PNG, SVG and PDF; a timeline says it has no memory."""
    code, out, _ = cli(["plot", "gantt", str(files["t.json.gz"]), "-o", str(tmp_path / "g.png")])
    assert code == 0 and out == f"wrote gantt: {tmp_path / 'g.png'}\n"
    width, height = png_size(tmp_path / "g.png")
    assert width > 1500 and height > 1000
    code, _, err = cli(["plot", "gantt", str(files["t.parquet"]), "--microbatches", "4", "-o",
                        str(tmp_path / "g.svg")])
    assert code == 0 and "no memory panel" in err
    assert_svg(tmp_path / "g.svg")
    code, _, err = cli(["plot", "gantt", str(files["t.json.gz"]), "--microbatches", "3", "-o", str(tmp_path / "x.png")])
    assert code == 2 and "--microbatches: got 3, but the file's OPT rows close an iteration every 4 microbatches" \
        in err and not (tmp_path / "x.png").exists()  # iteration ends would be drawn in the wrong places
    code, _, _ = cli(["plot", "gantt", str(files["t.csv"]), "--mode", "steps", "--format", "pdf", "-o",
                      str(tmp_path / "g.pdf")])
    assert code == 0 and (tmp_path / "g.pdf").read_bytes()[:5] == b"%PDF-"


def test_cli_gantt_from_a_config(cli, tmp_path: Path) -> None:
    """A config is simulated first, --set applied."""
    config = tmp_path / "c.yaml"
    config.write_text("schedule: {name: zb-v, stages: 2, microbatches: 4}\ncosts: {kind: uniform}\n")
    code, _, _ = cli(["plot", "gantt", str(config), "--set", "schedule.microbatches=6", "-o", str(tmp_path / "z.png")])
    assert code == 0 and png_size(tmp_path / "z.png")[0] > 1000
    code, _, _ = cli(["plot", "memory", "demo", "--set", "schedule.microbatches=4", "-o", str(tmp_path / "d.png")])
    assert code == 0 and png_size(tmp_path / "d.png")[0] > 1000  # a shipped config by name, as simulate takes it


def test_memory_figure_and_cli(twobw: pipescope.SimResult, cli, files: dict[str, Path], tmp_path: Path) -> None:
    """One line per device, in the unit the peak reads best in, peaking at the run's peak; PNG and SVG from the
    trace."""
    fig = memory_figure(twobw)
    try:
        ax = fig.axes[0]
        assert [line.get_label() for line in ax.lines] == [f"device {d}" for d in range(4)]
        peak = max(line.get_ydata().max() for line in ax.lines)
        unit, unit_bytes = byte_unit(twobw.peak_memory_bytes)
        assert peak == pytest.approx(twobw.peak_memory_bytes / unit_bytes) and 1 <= peak < 1024
        assert ax.get_ylabel() == f"memory ({unit})"
        assert fig.get_suptitle().startswith("2bw:") and ax.get_title(loc="left").startswith("bytes in use per device")
        assert "memory per device" not in fig.get_suptitle()  # said once, by the axes
    finally:
        plt.close(fig)
    for name in ("m.png", "m.svg"):
        assert cli(["plot", "memory", str(files["t.json.gz"]), "-o", str(tmp_path / name)])[0] == 0
    assert png_size(tmp_path / "m.png")[0] > 1000
    assert_svg(tmp_path / "m.svg")


def test_bubble_and_throughput_from_a_sweep(cli, files: dict[str, Path], tmp_path: Path) -> None:
    """A line per schedule and value of every other key that varies (the failed run dropped); the bubble falls as
    m grows; throughput lines take the best split at each GPU count; PNG and SVG from Parquet and CSV."""
    frame = read_sweep(str(files["sweep.parquet"]), "bubble")
    assert len(frame) == 36
    fig = bubble_figure(frame)
    try:
        lines = fig.axes[0].lines
        assert sorted(line.get_label() for line in lines) == sorted(
            f"{name} (stages={p}, data_parallel={w})" for name in ("gpipe", "1f1b", "zb-h1") for p in (2, 4)
            for w in (1, 2))
        for line in lines:
            assert list(line.get_xdata()) == [4, 8, 16] and np.all(np.diff(line.get_ydata()) < 0)
        assert "%" in fig.axes[0].get_ylabel()
        low, high = fig.axes[0].get_ylim()
        assert all(low < y < high for line in lines for y in line.get_ydata())  # 0% markers not cut by the frame
    finally:
        plt.close(fig)
    fig = throughput_figure(read_sweep(str(files["sweep.parquet"]), "throughput"))
    try:
        ax = fig.axes[0]
        *lines, ideal = ax.lines
        assert len(lines) == 9  # 3 schedules x 3 values of m
        assert all(list(line.get_xdata()) == [2, 4, 8] for line in lines)
        assert ax.get_ylabel() == "throughput (samples/s)" and (ax.get_xscale(), ax.get_yscale()) == ("log", "log")
        assert ideal.get_label() == "ideal: linear from the best at 2 GPUs"
        assert np.allclose(ideal.get_ydata(), ideal.get_ydata()[0] * np.array([1, 2, 4]))
        assert ideal.get_ydata()[0] == max(line.get_ydata()[0] for line in lines)
        # one colour per schedule, the one every figure gives it (experiments/palette.py)
        for line in lines:
            assert line.get_color() == schedule_color(line.get_label().split(" ")[0])
        low, high = ax.get_ylim()
        assert all(low < y < high for line in lines for y in line.get_ydata())  # no marker on the frame
        fig.canvas.draw()  # the log axis' labels plain numbers (400), not 4×10²
        labels = [t.get_text() for t in (*ax.get_yticklabels(), *ax.get_yticklabels(minor=True)) if t.get_text()]
        assert labels and all(re.fullmatch(r"[0-9.]+", text) for text in labels), labels
    finally:
        plt.close(fig)
    table = read_sweep(str(files["sweep.parquet"]), "throughput")
    one_count = table[table["schedule.stages"] * table["cluster.data_parallel"] == 4]
    fig = throughput_figure(one_count)  # one vertical stack of markers before: a bar per line now
    try:
        bars = fig.axes[0].patches
        assert len(bars) == 9  # 3 schedules x 3 values of m, as the lines
        assert {matplotlib.colors.to_hex(bar.get_facecolor()) for bar in bars} == {
            schedule_color(name).lower() for name in ("gpipe", "1f1b", "zb-h1")}
        assert "does not vary the GPU count" in fig.axes[0].get_title()
    finally:
        plt.close(fig)
    table = read_sweep(str(files["sweep.parquet"]), "throughput")
    fastest = table["throughput_samples_per_s"].idxmax()
    out_of_memory = table.assign(oom=table.index == fastest)  # the fastest run does not fit: it is no best split
    fig = throughput_figure(out_of_memory)
    try:
        top = max(max(line.get_ydata()) for line in fig.axes[0].lines[:-1])  # the last is the ideal line
        assert top < table.loc[fastest, "throughput_samples_per_s"]
    finally:
        plt.close(fig)
    with pytest.raises(ValueError, match="every run is out of memory"):
        throughput_figure(table.assign(oom=True))
    for kind in ("bubble", "throughput"):
        for source, name in ((files["sweep.parquet"], f"{kind}.png"), (files["sweep.csv"], f"{kind}.svg")):
            assert cli(["plot", kind, str(source), "-o", str(tmp_path / name)])[0] == 0
        assert png_size(tmp_path / f"{kind}.png")[0] > 800
        assert_svg(tmp_path / f"{kind}.svg")


def test_overlay_from_validate_report_and_two_timelines(cli, files: dict[str, Path], tmp_path: Path) -> None:
    """A validate report draws predicted beside measured (iteration, busy time, peak memory); two timelines draw one
    above the other."""
    fig = validate_figure(json.loads(files["validate.json"].read_text()))
    try:
        iteration, busy, memory = fig.axes
        assert len(iteration.patches) == 2 and len(busy.patches) == len(memory.patches) == 4  # 2 devices x 2 sides
        assert [t.get_text() for t in busy.get_xticklabels()] == ["device 0", "device 1"]
        # GiB: a tiny model's peak is mostly what a GPU process holds besides tensors (docs/memory.md)
        assert memory.get_ylabel() == "peak memory (GiB)" and legend(busy) == ["predicted", "measured"]
    finally:
        plt.close(fig)
    for name in ("v.png", "v.svg"):
        assert cli(["plot", "overlay", str(files["validate.json"]), "-o", str(tmp_path / name)])[0] == 0
    assert_svg(tmp_path / "v.svg")
    assert png_size(tmp_path / "v.png")[0] > 1000
    code, _, _ = cli(["plot", "overlay", str(files["t.parquet"]), str(files["measured.parquet"]), "-o",
                      str(tmp_path / "o.png")])
    assert code == 0 and png_size(tmp_path / "o.png")[0] > 1000
    report = json.loads(files["validate.json"].read_text())
    first = report["per_device"][0]
    for change, needle in [({"measured_iteration_time_s": 0}, "measured_iteration_time_s: got 0, expected a time "
                                                              "above 0"),
                           ({"per_device": [first, first]}, "per_device[1].device: got 0 twice, expected each device "
                                                             "once"),
                           ({"per_device": [{**first, "measured_busy_s": -1}]}, "per_device[0].measured_busy_s: "
                                                                                  "got -1, expected >= 0"),
                           ({"per_device": [{**first, "device": 0.5}]}, "per_device[0].device: got '0.5', expected "
                                                                         "an integer from 0 to 99,999")]:
        bad = tmp_path / "bad.json"
        bad.write_text(json.dumps({**report, **change}))
        code, _, err = cli(["plot", "overlay", str(bad), "-o", str(tmp_path / "b.png")])
        assert code == 2 and needle in err and err.count("\n") == 1
    from pipescope.experiments.plots_inputs import read_validate
    wrong = {**report, "iteration_time_error": 0.5}  # the title shows the times' error, not a stored one
    expected = report["predicted_iteration_time_s"] / report["measured_iteration_time_s"] - 1
    assert read_validate(wrong, "r.json")["iteration_time_error"] == pytest.approx(expected)


def test_default_output_name(cli, files: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without -o the figure is INPUT's name with -KIND.FORMAT, in the current folder."""
    monkeypatch.chdir(tmp_path)
    assert cli(["plot", "memory", str(files["t.json.gz"]), "--format", "svg"])[0] == 0
    assert_svg(tmp_path / "t-memory.svg")


def hostile_files(folder: Path, files: dict[str, Path]) -> dict[str, Path]:
    """Files a user (or an attacker) might hand `plot`."""
    op = {"ph": "X", "tid": 0, "ts": 0, "dur": 1, "args": {"action": "0F0", "stage": 0, "microbatch": 0}}
    made = {
        "garbage.parquet": b"PAR1 this is not parquet PAR1",
        "text.json": b"{\"traceEvents\": [",
        "nan.json": b"{\"traceEvents\": [{\"ph\": \"X\", \"pid\": NaN}]}",
        "dicttid.json": json.dumps({"traceEvents": [{**op, "pid": 0, "tid": {}}]}).encode(),
        "listargs.json": json.dumps({"traceEvents": [{**op, "pid": 0, "args": [1]}]}).encode(),
        "nullgib.json": json.dumps({"traceEvents": [op, {"ph": "C", "name": "memory", "pid": 0, "ts": 0,
                                                         "args": {"GiB": None}}]}).encode(),
        "deep.json": b"[" * 100_000 + b"]" * 100_000,
        "bigpid.json": json.dumps({"traceEvents": [{**op, "pid": 10**7}]}).encode(),
        "badlane.json": json.dumps({"traceEvents": [{**op, "pid": 0}]}).encode(),  # no thread_name for its tid
        "bomb.json.gz": gzip.compress(b" " * (2 << 20)),
        "many.json.gz": gzip.compress(json.dumps({"traceEvents": [op] * 1001}).encode()),  # over a bound of 1,000
        # no "ph" to count, and each a Python object once parsed: refused before parsing
        "empties.json.gz": gzip.compress(json.dumps({"traceEvents": [{}] * 3001}).encode()),
        "ones.json.gz": gzip.compress(json.dumps({"traceEvents": [1] * 12_002}).encode()),
    }
    paths = {}
    for name, data in made.items():
        paths[name] = folder / name
        paths[name].write_bytes(data)
    timeline = pd.read_csv(files["t.csv"])
    paths["negative.csv"] = folder / "negative.csv"
    timeline.assign(start_ns=-timeline["start_ns"]).to_csv(paths["negative.csv"], index=False)
    paths["nobubble.parquet"] = folder / "nobubble.parquet"
    pd.read_parquet(files["sweep.parquet"]).drop(columns="bubble_rate").to_parquet(paths["nobubble.parquet"])
    paths["manylines.csv"] = folder / "manylines.csv"
    pd.DataFrame({"schedule.name": [f"s{i}" for i in range(41)], "schedule.microbatches": 4,
                  "bubble_rate": 0.1}).to_csv(paths["manylines.csv"], index=False)
    paths["bomb.parquet"] = folder / "bomb.parquet"  # a few KiB on disk, 4 MiB of columns once unpacked
    pd.DataFrame({"device": [f"{i:08d}" + "0" * 4088 for i in range(1024)]}).to_parquet(paths["bomb.parquet"],
                                                                                          compression="zstd")
    paths["uniformvocab.parquet"] = folder / "uniformvocab.parquet"  # a uniform-cost sweep: no model, no vocab
    pd.read_parquet(files["sweep.parquet"]).assign(**{"model.vocab": None}).to_parquet(paths["uniformvocab.parquet"])
    paths["broken.yaml"] = folder / "broken.yaml"
    paths["broken.yaml"].write_text("schedule: [1\n")
    paths["badrate.csv"] = folder / "badrate.csv"
    pd.read_csv(files["sweep.csv"]).assign(bubble_rate=7.0).to_csv(paths["badrate.csv"], index=False)
    paths["wide.csv"] = folder / "wide.csv"  # a timeline with 10,001 more names (pandas: ~5 KB and 50 us each)
    header, rows = files["t.csv"].read_text().split("\n", 1)
    paths["wide.csv"].write_text(header + "".join(f",c{i}" for i in range(10_001)) + "\n" + rows)
    return paths


BAD = [
    (["gantt", "{missing}"], "INPUT: '{missing}' does not exist or is not a file"),
    (["gantt", "{garbage.parquet}"], "is not a readable Parquet table"),
    (["gantt", "{text.json}"], "is not valid JSON"),
    (["gantt", "{nan.json}"], "is not valid JSON (NaN is not a number"),
    (["gantt", "{deep.json}"], "is not valid JSON"),
    (["gantt", "{bigpid.json}"], "pid: got '10000000', expected an integer from 0 to 99,999"),
    (["gantt", "{badlane.json}"], "thread name: stream: got '', expected compute"),
    (["gantt", "{bomb.json.gz}"], "is over 1 MiB"),
    (["gantt", "{many.json.gz}"], "has 1,001 events, expected at most 1,000"),
    (["gantt", "{dicttid.json}"], "traceEvents[0].tid: got '{}', expected a number or a name"),
    (["gantt", "{listargs.json}"], "traceEvents[0].args: got '[1]', expected an object"),
    (["gantt", "{nullgib.json}"], "traceEvents[1].args.GiB: got 'None', expected a number of GiB"),
    (["gantt", "{empties.json.gz}"], "holds 3,002 JSON objects and 3,000 commas, more than a trace of 1,000 events"),
    (["gantt", "{ones.json.gz}"], "holds 1 JSON objects and 12,001 commas, more than a trace of 1,000 events"),
    (["gantt", "{negative.csv}"], "start_ns: got '-"),
    (["gantt", "{summary.json}"], "is a 'simulate --json' summary, which holds no op timeline"),
    (["gantt", "{validate.json}"], "is a 'validate --json' report (plot it with overlay)"),
    (["gantt", "{sweep.parquet}"], "has no column 'device', expected a timeline"),
    (["gantt", "{t.parquet}", "{t.csv}"], "INPUT: got 2 files, expected one for gantt"),
    (["gantt", "{broken.yaml}"], "INPUT: '{broken.yaml}': line 2:"),  # the file is INPUT, not a --config flag
    (["gantt", "{t.parquet}", "--set", "schedule.stages=2"], "--set: only with a config INPUT"),
    (["gantt", "{t.parquet}", "--microbatches", "0"], "--microbatches: got '0', expected an integer from 1"),
    (["memory", "{t.parquet}"], "holds no memory timeline"),
    (["memory", "{sweep.csv}"], "is a table (a timeline or a sweep), which holds no memory timeline; expected a "
                                "Chrome trace"),
    (["memory", "uniform-theory"], "INPUT: 'uniform-theory' counted no bytes (uniform costs"),  # not a flat chart
    (["bubble", "{nobubble.parquet}"], "has no column 'bubble_rate', expected a sweep table"),
    (["vocab", "{uniformvocab.parquet}"], "model.vocab is empty in every run (a sweep under uniform costs"),
    (["bubble", "{badrate.csv}"], "bubble_rate: got '7.0', expected a number from 0 to 1"),
    (["bubble", "{manylines.csv}"], "bubble_rate: 41 lines (schedules x nothing else), expected at most 40"),
    (["gantt", "{bomb.parquet}"], "unpacks to"),
    (["gantt", "{wide.csv}"], "INPUT: '{wide.csv}': its header has 10,011 comma-separated names, expected at most"),
    (["throughput", "{t.json.gz}"], "expected a sweep table (.parquet or .csv)"),
    (["memory", "{t.json.gz}", "--title", "x" * 301], "--title: got 301 characters, expected at most 300"),
    (["overlay", "{summary.json}"], "is not a 'pipescope validate --json' report"),
    (["gantt", "{t.json.gz}", "-o", "g.jpg"], "-o: got 'g.jpg', expected a file name ending in .png, .svg or .pdf"),
    (["gantt", "{t.json.gz}", "-o", "g.png", "--format", "svg"],
     "-o: got 'g.png', but the format asked for is svg; expected a .svg name"),
    (["gantt", "{t.json.gz}", "-o", "{t.csv}/g.png"], "-o: cannot write"),
    (["bubble", "{sweep.csv}", "--mode", "steps"], "--mode: only with gantt, not bubble"),
    (["memory", "{t.json.gz}", "--compute-only"], "--compute-only: only with gantt, not memory"),
    (["memory", "{t.json.gz}", "--no-memory"], "--no-memory: only with gantt, not memory"),
    (["throughput", "{sweep.csv}", "--microbatches", "4"], "--microbatches: only with gantt or memory, not throughput"),
    (["bubble", "{sweep.csv}", "--set", "schedule.stages=2"], "--set: only with gantt or memory, not bubble"),
]


@pytest.mark.parametrize(("args", "message"), BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_input_is_one_line_and_exit_2(cli, files: dict[str, Path], tmp_path: Path, args: list[str], message: str,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(plots_inputs, "MAX_FILE_BYTES", 1 << 20)  # the gzip bomb: 2 MiB unpacked, over a 1 MiB bound
    monkeypatch.setattr(plots_inputs, "MAX_UNPACKED_BYTES", 2 << 20)  # the Parquet bomb: 4 MiB, over a 2 MiB bound
    monkeypatch.setattr(plots_inputs, "MAX_TRACE_EVENTS", 1000)  # counted before the JSON is parsed
    names = {**{k: str(v) for k, v in files.items()}, **{k: str(v) for k, v in hostile_files(tmp_path, files).items()},
             "missing": str(tmp_path / "missing.json")}
    def fill(text: str) -> str:  # "{t.csv}" is that file's path (str.format would read ".csv" as an attribute)
        return re.sub(r"\{([^}]+)\}", lambda match: names[match.group(1)], text)

    code, out, err = cli(["plot", *map(fill, args)])
    assert code == 2 and out == ""
    assert err.startswith("pipescope: error: ") and err.count("\n") == 1, err
    assert fill(message) in err


def test_unknown_kind_is_a_usage_error(capsys: pytest.CaptureFixture) -> None:
    """argparse's one-line error (exit 2) lists the kinds."""
    from pipescope.experiments.cli import main
    with pytest.raises(SystemExit) as exit_info:
        main(["plot", "pie", "x.json"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1 and "choose from 'gantt', 'memory'" in err


def test_a_title_with_tex_is_drawn_as_text(cli, files: dict[str, Path], tmp_path: Path) -> None:
    """A '$' in a title is not TeX math (an unbalanced one would fail to render)."""
    code, _, _ = cli(["plot", "memory", str(files["t.json.gz"]), "--title", "cost $\\frac{", "-o",
                      str(tmp_path / "t.png")])
    assert code == 0 and png_size(tmp_path / "t.png")[0] > 1000


def test_byte_unit_reads_the_peak_as_at_least_one() -> None:
    assert byte_unit(2.6 * 2**20) == ("MiB", 2**20)  # a small CPU run: 2.6 MiB, not 0.0025 GiB
    assert byte_unit(80 * 2**30) == ("GiB", 2**30) and byte_unit(512) == ("KiB", 2**10)


def test_pipedream_iterations_come_from_the_flag_its_opt_rows_do_not_tell(cli, tmp_path: Path) -> None:
    """PipeDream steps after every microbatch (OPT rows 0, 1, 2, ...), so its rows give no iteration size:
    --microbatches is taken, and iteration ends are drawn every m microbatches."""
    path = tmp_path / "pd.csv"
    write_timeline(uniform("pipedream", 2, 4), str(path))
    data = run_from_timeline(str(path), 4)
    assert data.microbatches == 4
    assert run_from_timeline(str(path), None).microbatches == 0  # unknown without it: no iteration marks
    assert cli(["plot", "gantt", str(path), "--microbatches", "4", "-o", str(tmp_path / "pd.png")])[0] == 0


def test_figures_from_python_refuse_what_they_cannot_draw(twobw: pipescope.SimResult, tmp_path: Path) -> None:
    """The Python entry points check their input as the command does: a one-line ValueError, not a KeyError from
    pandas, and no PNG bytes under a .jpg name."""
    cases = [(bubble_figure, twobw.timeline, "INPUT: no column 'schedule.name'; expected a sweep's table"),
             (throughput_figure, twobw.summary(), "INPUT: got dict, expected a pandas DataFrame"),
             (vocab_figure, twobw.timeline, "INPUT: no column 'schedule.name'; expected a sweep over model.vocab"),
             (gantt_figure, twobw.summary(), "result: got dict, expected a SimResult"),
             (memory_figure, twobw.timeline, "result: got DataFrame, expected a SimResult")]
    for draw, given, message in cases:
        with pytest.raises(ValueError, match=f"^{re.escape(message)}"):
            draw(given)
    for name, fmt, message in (("g.jpg", None, "expected a file name ending in .png, .svg or .pdf"),
                               ("g", None, "expected a file name ending in .png, .svg or .pdf"),
                               ("g.png", "svg", "but the format asked for is svg; expected a .svg name")):
        with pytest.raises(ValueError, match=re.escape(message)):
            save_figure(memory_figure(twobw), str(tmp_path / name), fmt)
        assert not (tmp_path / name).exists()
    save_figure(memory_figure(twobw), str(tmp_path / "g.SVG"))
    assert_svg(tmp_path / "g.SVG")


def test_a_timelines_other_columns_are_never_read(files: dict[str, Path], tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A timeline is read by its own columns alone: what another column holds (here 3 MiB of text, over a bound of
    2 MiB once unpacked) costs nothing, where a table read whole (a sweep's) is refused from its footer."""
    monkeypatch.setattr(plots_inputs, "MAX_UNPACKED_BYTES", 2 << 20)
    frame = pd.read_parquet(files["t.parquet"])
    width = (3 << 20) // len(frame) + 1
    path = tmp_path / "bulky.parquet"
    frame.assign(note=[f"{i:08d}".ljust(width, "x") for i in range(len(frame))]).to_parquet(path, compression="zstd")
    assert len(run_from_timeline(str(path), None).ops) == len(run_from_timeline(str(files["t.parquet"]), None).ops)
    with pytest.raises(ValueError, match="unpacks to"):
        plots_inputs.read_table(str(path), ("device",), "a table")


def test_throughput_counts_every_gpu_a_run_used_and_an_unset_key_reads_unset() -> None:
    """Runs that split 8 GPUs as tensor 1, 2, 4 x 4, 2, 1 replicas were drawn at 2, 4 and 8 GPUs (stages x replicas),
    with an ideal line that made equal GPU counts look like poor scaling; a null shard group read '<NA>'."""
    frame = pd.DataFrame({"schedule.name": ["1f1b"] * 4, "schedule.stages": [2, 2, 2, 2],
                          "parallel.tensor": [1, 2, 4, 4], "cluster.data_parallel": [4, 2, 1, 2],
                          "gpus": [8, 8, 8, 16], "throughput_samples_per_s": [50.0, 54.0, 40.0, 90.0],
                          "parallel.shard_group": pd.array([pd.NA, pd.NA, pd.NA, pd.NA], dtype="Int64"),
                          "parallel.zero": [0, 0, 0, 0]})
    fig = throughput_figure(frame)
    try:
        line, ideal = fig.axes[0].lines
        assert list(line.get_xdata()) == [8, 16] and list(line.get_ydata()) == [54.0, 90.0]  # the best split of 8
        assert fig.axes[0].get_xlabel() == "GPUs"
    finally:
        plt.close(fig)
    grouped = pd.concat([frame, frame.assign(**{"parallel.shard_group": pd.array([2] * 4, dtype="Int64")})])
    fig = throughput_figure(grouped)
    try:
        labels = {line.get_label() for line in fig.axes[0].lines}
        assert "1f1b (shard_group=unset)" in labels and not any("<NA>" in label for label in labels)
    finally:
        plt.close(fig)


def test_lines_of_a_number_come_in_its_order_not_as_text() -> None:
    """A sweep over microbatches 4, 8 and 16 at one GPU count drew its bars 16, 4, 8 (their labels sorted as text)."""
    frame = pd.DataFrame({"schedule.name": ["1f1b"] * 3, "schedule.stages": [2, 2, 2], "gpus": [4, 4, 4],
                          "schedule.microbatches": [16, 4, 8], "throughput_samples_per_s": [3.0, 1.0, 2.0]})
    fig = throughput_figure(frame)
    try:
        labels = [tick.get_text() for tick in fig.axes[0].get_yticklabels()]
        assert labels == [f"1f1b (microbatches={m})" for m in (4, 8, 16)]
    finally:
        plt.close(fig)


@pytest.mark.parametrize("gpus", [0, -1, 10**15])
def test_a_throughput_table_with_impossible_gpus_is_refused_at_once(gpus: int) -> None:
    """0 GPUs divided the ideal line by zero and the chart never finished (a helper's edited results.csv); a
    negative or absurd count drew an image a million pixels wide. Each is one error naming the column."""
    frame = pd.DataFrame({"schedule.name": ["1f1b"] * 2, "schedule.stages": [2, 2], "gpus": [gpus, 8],
                          "throughput_samples_per_s": [50.0, 90.0]})
    with pytest.raises(ValueError, match=rf"^INPUT: gpus: got '{gpus}', expected a whole number of GPUs from 1 to "):
        throughput_figure(frame)


def test_a_gantt_names_the_collectives_it_draws_and_only_the_panels_it_has() -> None:
    """A run without replicas reduces only clipping's norm, which the legend called a gradient all-reduce; a
    summarised Gantt's subtitle spoke of a memory panel it did not draw."""
    result = pipescope.run(pipescope.load_config("demo", ["schedule.microbatches=300"]))
    fig = gantt_figure(result)
    try:
        labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
        assert "clipping's norm all-reduce" in labels and "gradient all-reduce" not in labels
        assert "more than" in fig.axes[0].get_title() and "memory" not in fig.axes[0].get_title()
    finally:
        plt.close(fig)
    fig = gantt_figure(result, memory=True)
    try:
        assert "memory its range in each" in fig.axes[0].get_title()
    finally:
        plt.close(fig)


def test_a_steps_gantt_counts_what_check_counts_without_the_optimizer_steps() -> None:
    """An analytic 2BW run's steps Gantt said 57 unit steps where `check` says 54: each optimizer step took one."""
    from pipescope.simulator.check import unit_steps as check_steps

    result = pipescope.run(pipescope.load_config(None, ["schedule.name=2bw", "schedule.stages=4",
                                                        "schedule.microbatches=8"]))
    fig = gantt_figure(result, mode="steps")
    try:
        steps = check_steps(pipescope.run(pipescope.load_config(None, [
            "costs.kind=uniform", "schedule.name=2bw", "schedule.stages=4", "schedule.microbatches=8"])).schedule)
        assert f"  {steps} unit steps" in fig.axes[0].get_title() and steps == 54
    finally:
        plt.close(fig)


def test_the_memory_figure_of_replicas_says_it_draws_replica_0() -> None:
    """A helper's 64-device trace drew 4 devices with nothing saying the other 60 are replicas of them (the Gantt
    says so)."""
    replicas = run("schedule.stages=4", "schedule.microbatches=4", "cluster.nodes=2", "cluster.data_parallel=4")
    fig = memory_figure(replicas)
    try:
        assert len(fig.axes[0].lines) == 4
        assert fig.get_suptitle().endswith("(replica 0 of 4: each holds the same)")
    finally:
        plt.close(fig)
