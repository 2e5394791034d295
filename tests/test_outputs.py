"""Chrome trace, Gantt chart, timeline files and the `make demo` command."""

import gzip
import json
import os
import subprocess
import sys

import pandas as pd

from pipescope.experiments.plots import gantt_figure, write_gantt
from pipescope.experiments.tables import write_timeline
from pipescope.simulator.costs import UniformCosts
from pipescope.simulator.network import FifoLinks
from pipescope.simulator.schedules import build
from pipescope.simulator.simulate import simulate
from pipescope.simulator.trace import chrome_trace, write_trace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def small_result():
    return simulate(build("1f1b", 3, 4), UniformCosts(activation_bytes=2**20), FifoLinks.fixed_delay(100_000_000))


def test_chrome_trace_structure(tmp_path) -> None:
    """One named process per device, named compute and send lanes, an X event per op and transfer."""
    result = small_result()
    path = tmp_path / "t.json.gz"
    write_trace(result, str(path))
    trace = json.loads(gzip.decompress(path.read_bytes()))
    events = trace["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {0: "device 0", 1: "device 1", 2: "device 2"}
    lanes = {(e["pid"], e["args"]["name"]) for e in events if e["name"] == "thread_name"}
    assert (0, "compute") in lanes and (0, "send->1") in lanes and (2, "send->1") in lanes
    ops = [e for e in events if e["ph"] == "X"]
    assert len(ops) == len(result.timeline)
    first = min((e for e in ops if e["pid"] == 1 and e["cat"] == "forward"), key=lambda e: e["ts"])
    assert first["ts"] == 1.1e6 and first["dur"] == 1e6  # F0 on device 1 after F on device 0 + p2p, in us
    counters = [e for e in events if e["ph"] == "C"]
    assert {e["pid"] for e in counters} == {0, 1, 2}
    assert max(e["args"]["GiB"] for e in counters if e["pid"] == 0) > 0


def test_trace_uncompressed(tmp_path) -> None:
    """A .json name writes plain JSON equal to the in-memory trace."""
    result = small_result()
    write_trace(result, str(tmp_path / "t.json"))
    assert json.loads((tmp_path / "t.json").read_text()) == json.loads(json.dumps(chrome_trace(result)))


def test_gantt_png_large_pipeline(tmp_path) -> None:
    """ZB-V at p=32, m=128 (24,576 ops) renders; F, I, W and both chunks get their own colours, one collection
    per device, kind and chunk parity, with no per-op labels or edges at that size."""
    result = simulate(build("zb-v", 32, 128), UniformCosts())
    fig = gantt_figure(result)
    ax = fig.axes[0]
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == ["forward", "input-grad", "weight-grad", "forward, odd chunk", "input-grad, odd chunk",
                      "weight-grad, odd chunk"]
    faces = {tuple(c.get_facecolor()[0]) for c in ax.collections}
    assert len(ax.collections) == 32 * 3 * 2 and len(faces) == 6
    assert not ax.texts
    path = tmp_path / "g.png"
    write_gantt(result, str(path))
    assert path.read_bytes()[:8] == PNG_MAGIC


def test_timeline_parquet_and_csv(tmp_path) -> None:
    """The timeline round-trips through Parquet and CSV with its columns and row count."""
    result = small_result()
    for name in ("t.parquet", "t.csv"):
        write_timeline(result, str(tmp_path / name))
        frame = pd.read_parquet(tmp_path / name) if name.endswith("parquet") else pd.read_csv(tmp_path / name)
        assert list(frame.columns) == list(result.timeline.columns)
        assert len(frame) == 3 * 4 * 2 + 2 * (2 * 4 * 2)  # ops, then each transfer as a send and a recv row


def test_make_demo_command(tmp_path) -> None:
    """`make demo` runs `make demo-run`; the same target here prints the table and writes both files."""
    out = tmp_path / "demo"
    command = ["make", "-s", "--no-print-directory", "demo-run",
               f"PIPESCOPE={sys.executable} -m pipescope.experiments.cli", f"DEMO_OUT={out}"]
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "1f1b: p=4 m=8" in proc.stdout and "iteration time" in proc.stdout and "bubble rate" in proc.stdout
    assert (out / "gantt.png").read_bytes()[:8] == PNG_MAGIC
    trace = json.loads(gzip.decompress((out / "trace.json.gz").read_bytes()))
    processes = [e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"]
    assert processes == ["device 0", "device 1", "device 2", "device 3", "network"]
