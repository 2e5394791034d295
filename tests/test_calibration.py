"""The calibration harness on CPU: a real profile of a small model, byte counts, bad input, comms under torchrun."""

from __future__ import annotations

import ast
import json
import math
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from pipescope.calibration import commands, commfit  # noqa: E402 (after the torch skip)
from pipescope.calibration.memory import saved_tensor_bytes  # noqa: E402
from pipescope.calibration.model import GPT, Block  # noqa: E402
from pipescope.calibration.profile_io import write_table  # noqa: E402
from pipescope.simulator.readers.profile_schema import ProfileError  # noqa: E402
from pipescope.calibration.timing import Bench, CpuTimer, Timer, TimingConfig, is_stable, stats  # noqa: E402
from pipescope.simulator.network import link_transfer_ns  # noqa: E402
from pipescope.simulator.profiled import ProfiledCosts  # noqa: E402

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[1]

# Big enough that the matmuls, not Python overhead, dominate a step (about 0.2 s on one core), small enough that
# calibrating two microbatch sizes takes about 15 s. The `tiny` preset (h64, seq 32) is mostly interpreter time.
SHAPE = {"layers": 4, "hidden": 256, "heads": 4, "seq": 128, "vocab": 2048}
MICROBATCH = 4


def calibrate_args(out: Path, *extra: str) -> list[str]:
    shape = [arg for key, value in SHAPE.items() for arg in (f"--{key}", str(value))]
    return ["calibrate", *shape, "--microbatch-sizes", f"2,{MICROBATCH}", "--device", "cpu", "--threads", "1",
            "--vocab-shards", "2", "--budget-s", "0.5", "--max-spread", "1000", "--out", str(out), *extra]
    # --max-spread 1000: these tests are about the profile, not this shared machine's noise (that warning has its
    # own tests in tests/test_noisy_calibration.py)


class TrainingLoop:
    """The whole test model with AdamW: real forward + backward + optimizer steps to check predictions against."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = GPT(**SHAPE)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.ids, self.targets = (torch.randint(SHAPE["vocab"], (MICROBATCH, SHAPE["seq"])) for _ in range(2))
        self.sample(3)  # the first steps allocate optimizer state

    def sample(self, steps: int) -> list[int]:
        """Wall times (ns) of ``steps`` training steps."""
        samples = []
        for _ in range(steps):
            start = time.perf_counter_ns()
            self.optimizer.zero_grad()
            self.model(self.ids, self.targets).backward()
            self.optimizer.step()
            samples.append(time.perf_counter_ns() - start)
        return samples


@dataclass(frozen=True)
class Calibrated:
    """A profile folder, how long calibrating took, and the measured real step time."""

    out: Path
    seconds: float
    step_ns: float
    params: int
    tensors: int


def calibrate_and_time(out: Path) -> Calibrated:
    """A CPU calibration of the test model into ``out``. The real step is timed just before and just after it
    (median of both halves), so a load change on this shared machine during the calibration affects both sides."""
    loop = TrainingLoop()
    before = loop.sample(10)
    start = time.perf_counter()
    assert commands.main(calibrate_args(out)) == 0
    seconds = time.perf_counter() - start
    samples = before + loop.sample(10)
    params = list(loop.model.parameters())
    return Calibrated(out, seconds, statistics.median(samples), sum(p.numel() for p in params), len(params))


@pytest.fixture(scope="module")
def profile(tmp_path_factory: pytest.TempPathFactory) -> Calibrated:
    return calibrate_and_time(tmp_path_factory.mktemp("profile"))


def test_cpu_calibration_finishes_within_a_minute_and_loads(profile: Calibrated) -> None:
    """The profile is written in under a minute and ProfiledCosts reads it without warnings at a measured point."""
    assert profile.seconds < 60
    costs = ProfiledCosts.load(profile.out, MICROBATCH)
    assert costs.stage_cost(0, 1, 1).forward_ns > 0
    assert costs.notes() == []


def predicted_over_measured(profile: Calibrated) -> float:
    """Sum of layer F+I+W, embedding, output layer and optimizer step from the profile, over the real step."""
    costs = ProfiledCosts.load(profile.out, MICROBATCH)
    stage = costs.stage_cost(0, 1, 1)
    predicted = stage.forward_ns + stage.input_grad_ns + stage.weight_grad_ns + costs.optimizer_ns(
        profile.params, profile.tensors)
    print(f"predicted {predicted / 1e6:.1f} ms, measured {profile.step_ns / 1e6:.1f} ms, "
          f"ratio {predicted / profile.step_ns:.3f}")
    return predicted / profile.step_ns


def test_profiled_costs_predict_a_training_step_within_15_percent(profile: Calibrated, tmp_path: Path) -> None:
    """The profile predicts a real training step within 15%.

    This shared 2-core machine has bursts of load from other tenants; a burst during one side's timing
    window can move one measurement by more than 15% (seen once in about 20 suite runs; quiet runs land at
    0.94-1.06). So up to three independent attempts are made, each calibrating and timing afresh; the bound
    itself is never widened, and every attempt's ratio is printed (pytest -s).
    """
    ratios = [predicted_over_measured(profile)]
    for attempt in range(2):
        if abs(ratios[-1] - 1) < 0.15:
            break
        ratios.append(predicted_over_measured(calibrate_and_time(tmp_path / f"retry{attempt}")))
    assert abs(ratios[-1] - 1) < 0.15, f"predicted/measured ratios of three attempts: {ratios}"


def test_profile_metadata_records_where_and_how(profile: Calibrated) -> None:
    """Metadata carries the schema version, device, versions, thread count, the command and both tables."""
    meta = json.loads((profile.out / "profile.json").read_text())
    assert meta["schema_version"] == 1
    assert meta["device"]["type"] == "cpu" and meta["timing"]["threads"] == 1
    assert meta["versions"]["torch"] == torch.__version__
    assert "--microbatch-sizes 2,4" in meta["command"]
    assert set(meta["tables"]) == {"timings", "memory"}
    assert all((profile.out / name).is_file() for name in meta["tables"].values())


def test_profile_has_every_op_with_median_and_spread(profile: Calibrated) -> None:
    """Layer F/I/W/B/R, embedding F/W, output F/I/W/B, shard S/T/S2/T2 for 1..2 shards and optimizer steps are
    timed."""
    pd = pytest.importorskip("pandas")
    meta = json.loads((profile.out / "profile.json").read_text())
    path = profile.out / meta["tables"]["timings"]
    t = pd.read_parquet(path) if path.suffix == ".parquet" else pd.read_csv(path)
    ops = set(zip(t["component"], t["op"], strict=True))
    for component, names in {"layer": "FIWBR", "embedding": "FW", "output": "FIWB",
                              "output_shard": ("S", "T", "S2", "T2")}.items():
        assert {(component, op) for op in names} <= ops
    shard = t[t["component"] == "output_shard"]
    for op in ("S", "T", "S2", "T2"):
        assert sorted(shard[shard["op"] == op]["shards"]) == [1, 1, 2, 2]  # per shard count, per microbatch size
    assert ((t["p10_ns"] <= t["median_ns"]) & (t["median_ns"] <= t["p90_ns"]) & (t["reps"] >= 7)).all()
    assert (t["op"] == "step").sum() >= 3


def test_layer_byte_counts_match_saved_tensor_hooks(profile: Calibrated) -> None:
    """The profile's per-layer M_B equals a hook count on a fresh block; M_W is 16 b s h elements (ZB's 32sbh)."""
    costs = ProfiledCosts.load(profile.out, 2)
    block = Block(SHAPE["hidden"], SHAPE["heads"])
    x = torch.randn(2, SHAPE["seq"], SHAPE["hidden"], requires_grad=True)
    seen, _ = saved_tensor_bytes(lambda: block(x), exclude=block.parameters())
    assert costs.bytes_of("layer", "activation_bytes") == seen
    assert costs.bytes_of("layer", "weight_grad_bytes") == 16 * 2 * SHAPE["seq"] * SHAPE["hidden"] * 4


def test_activation_bytes_of_a_hand_checkable_layer() -> None:
    """Linear(h,4h) -> GELU -> Linear(4h,h) stashes x, the GELU input and the GELU output: 9 b s h floats."""
    b, s, h = 2, 8, 16
    mlp = torch.nn.Sequential(torch.nn.Linear(h, 4 * h), torch.nn.GELU(), torch.nn.Linear(4 * h, h))
    x = torch.randn(b, s, h, requires_grad=True)
    nbytes, _ = saved_tensor_bytes(lambda: mlp(x), exclude=mlp.parameters())
    assert nbytes == 4 * b * s * (h + 4 * h + 4 * h)


def test_deferred_input_and_weight_passes_equal_the_fused_backward() -> None:
    """I (input + LayerNorm grads) then W (Linear grads from the store) give the same gradients as one backward."""
    torch.manual_seed(0)
    block = Block(16, 2)
    x = torch.randn(2, 8, 16, requires_grad=True)
    dy = torch.randn_like(x)
    block(x).backward(dy)
    reference = {name: p.grad.clone() for name, p in block.named_parameters()}
    block.zero_grad(set_to_none=True)
    with block.store.defer():
        y = block(x)
    grads = torch.autograd.grad(y, [x, *block.undeferred_params()], dy)
    block.store.run()
    assert torch.allclose(grads[0], x.grad, atol=1e-6)
    for name, p in block.named_parameters():
        got = p.grad if p.grad is not None else grads[1 + [id(q) for q in block.undeferred_params()].index(id(p))]
        assert torch.allclose(got, reference[name], atol=1e-5), name


def test_a_profile_without_vocab2_rows_still_loads(profile: Calibrated, tmp_path: Path) -> None:
    """A profile calibrated before S2/T2 existed (their rows dropped) loads, with the same S and T shard times."""
    pd = pytest.importorskip("pandas")
    copy = Path(shutil.copytree(profile.out, tmp_path / "old"))
    meta = json.loads((copy / "profile.json").read_text())
    path = copy / meta["tables"]["timings"]
    t = pd.read_parquet(path) if path.suffix == ".parquet" else pd.read_csv(path)
    path.unlink()
    kept = t[~t["op"].isin(["S2", "T2"])]
    assert len(kept) == len(t) - 8
    meta["tables"]["timings"] = write_table(copy, "timings", kept.to_dict("records"))
    (copy / "profile.json").write_text(json.dumps(meta))
    assert ProfiledCosts.load(copy, MICROBATCH).vocab_shard_ns(2) == ProfiledCosts.load(
        profile.out, MICROBATCH).vocab_shard_ns(2)


class ScriptedTimer(Timer):
    """A timer whose repetitions take the scripted times (ns), cycling."""

    def __init__(self, config: TimingConfig, script: list[float]) -> None:
        super().__init__(config)
        self.script, self.calls = script, 0

    def _repeat(self, bench: Bench, count: int) -> list[float]:
        self.calls += count
        return [self.script[(self.calls - count + k) % len(self.script)] for k in range(count)]


def test_timer_stops_once_the_median_is_stable_and_caps_noisy_ops() -> None:
    """Steady times stop at min_reps; wildly noisy ones run to max_reps; the stats are ordered."""
    config = TimingConfig(warmup=0, min_reps=5, max_reps=40, budget_s=60)
    steady = ScriptedTimer(config, [100.0, 101.0]).measure(Bench(lambda _: None))
    noisy = ScriptedTimer(config, [100.0, 1000.0, 10.0]).measure(Bench(lambda _: None))
    assert steady.reps == 5 and noisy.reps == 40
    assert noisy.min_ns <= noisy.p10_ns <= noisy.median_ns <= noisy.p90_ns
    assert stats([3.0, 1.0, 2.0]).median_ns == 2
    assert not is_stable([1.0, 100.0, 1.0, 100.0, 50.0], rel_tol=0.02)


def test_cpu_timer_excludes_setup_from_the_timed_window() -> None:
    """A slow setup (20 ms sleep) does not show up in the time of a trivial op."""
    result = CpuTimer(TimingConfig(warmup=0, min_reps=3, max_reps=3)).measure(
        Bench(lambda _: None, lambda: time.sleep(0.02)))
    assert result.median_ns < 5_000_000


def run_cli(argv: list[str], capsys: pytest.CaptureFixture) -> tuple[int, list[str]]:
    code = commands.main(argv)
    return code, capsys.readouterr().err.strip().splitlines()


def test_microbatch_size_zero_is_a_one_line_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """--microbatch-sizes 1,0 exits 2 with one line naming the key and the value."""
    code, err = run_cli(["calibrate", "--model", "tiny", "--microbatch-sizes", "1,0", "--out", str(tmp_path)], capsys)
    assert code == 2 and err == ["pipescope: error: --microbatch-sizes: got 0, expected comma-separated positive "
                                 "integers, e.g. 1,2,4,8"]


def test_unwritable_output_dir_is_refused_before_measuring(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """An --out below a regular file (unwritable even for root) exits 2 naming --out, and writes nothing."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    code, err = run_cli(["calibrate", "--model", "tiny", "--device", "cpu", "--out", str(blocker / "p")], capsys)
    assert code == 2 and len(err) == 1 and err[0].startswith("pipescope: error: --out: ")
    assert "expected a writable folder" in err[0]


def test_profile_of_a_newer_schema_is_refused(profile: Calibrated, tmp_path: Path) -> None:
    """Bumping schema_version makes loading fail with a message that names the version and says to upgrade."""
    copy = Path(shutil.copytree(profile.out, tmp_path / "p"))
    meta = json.loads((copy / "profile.json").read_text())
    (copy / "profile.json").write_text(json.dumps({**meta, "schema_version": 2}))
    with pytest.raises(ProfileError, match="schema_version=2; expected 1 .*newer"):
        ProfiledCosts.load(copy, MICROBATCH)


def test_unknown_preset_is_a_one_line_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """--model gpt-9000 exits 2 with one line listing the presets."""
    code, err = run_cli(["calibrate", "--model", "gpt-9000", "--out", str(tmp_path)], capsys)
    assert code == 2 and err == [
        "pipescope: error: --model: got 'gpt-9000', expected one of tiny, tiny-512, gpt-355m, gpt-1.3b, gpt-2.2b, "
        "gpt-3.8b"]


BLOCKER = """
import sys
BLOCKED = ('simpy', 'yaml', 'matplotlib', 'pipescope.experiments', 'pipescope.topologies', 'pipescope.simulator.')
PLAIN = ('pipescope.simulator.ir', 'pipescope.simulator.models', 'pipescope.simulator.readers',
         *(f'pipescope.simulator.readers.{m}' for m in ('csvio', 'profile_schema', 'units', 'files')))
class Blocker:
    def find_spec(self, name, path=None, target=None):
        if name.startswith(BLOCKED) and name not in PLAIN:
            raise ImportError(f'blocked {name}')
sys.meta_path.insert(0, Blocker())
"""


def test_standalone_calibration_runs_without_simulator_dependencies(tmp_path: Path) -> None:
    """`python -m pipescope.calibration.commands calibrate` of `tiny` works with simpy, yaml and every
    simulator module but the stdlib-only IR unimportable (a GPU box with torch, numpy and pandas; torch itself
    brings networkx)."""
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(BLOCKER)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), str(ROOT)])}
    args = ["calibrate", "--model", "tiny", "--microbatch-sizes", "1", "--device", "cpu", "--threads", "1",
            "--vocab-shards", "1", "--warmup", "1", "--min-reps", "3", "--budget-s", "0.02",
            "--out", str(tmp_path / "p")]
    done = subprocess.run([sys.executable, "-m", "pipescope.calibration.commands", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    meta = json.loads((tmp_path / "p" / "profile.json").read_text())
    assert meta["model"]["name"] == "tiny"
    assert meta["command"].startswith("python -m pipescope.calibration.commands calibrate --model tiny ")  # to rerun


ALLOWED_THIRD_PARTY = {"torch", "numpy", "pandas", "pyarrow"}
# Stdlib-only too, but the cost models are what calibration feeds: keeping them out keeps calibration
# self-contained. simulator.models (model shapes and presets, plain data) is shared on purpose.
FORBIDDEN = {"pipescope.simulator.costs", "pipescope.simulator.profiled"}


def module_imports(path: Path) -> list[str]:
    """Absolute module names a file imports (relative imports are not used in this project)."""
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.append(node.module)
    return names


def is_plain_data_module(name: str) -> bool:
    """A project module importing only the standard library and other such modules (the IR, its CSV I/O)."""
    if name in ("pipescope", "pipescope.simulator", "pipescope.simulator.readers"):
        return True
    path = ROOT / (name.removeprefix("pipescope.").replace(".", "/") + ".py")
    return name not in FORBIDDEN and path.is_file() and all(
        n.split(".")[0] in sys.stdlib_module_names or is_plain_data_module(n) for n in module_imports(path))


def allowed_in_calibration(name: str) -> bool:
    if name.startswith(("pipescope.calibration", "pipescope.executor")):
        return True
    top = name.split(".")[0]
    return top in sys.stdlib_module_names or top in ALLOWED_THIRD_PARTY or is_plain_data_module(name)


def test_calibration_imports_only_torch_numpy_pandas_and_plain_data() -> None:
    """No module under calibration/ or executor/ imports simpy, networkx, yaml, the cost models or other simulator
    code: both run on a GPU box that has torch and no simulator dependencies."""
    for path in sorted([*(ROOT / "calibration").glob("*.py"), *(ROOT / "executor").glob("*.py")]):
        for name in module_imports(path):
            assert allowed_in_calibration(name), f"{path.name} imports {name}"
    assert allowed_in_calibration("pipescope.simulator.ir")
    assert not any(allowed_in_calibration(n) for n in ("simpy", "networkx", "yaml", "pipescope.simulator.costs"))


def test_calibration_imports_form_a_tree() -> None:
    """No import cycle among calibration modules, lazy (function-level) imports included."""
    graph = {path.stem: {n.removeprefix("pipescope.calibration.") for n in module_imports(path)
                         if n.startswith("pipescope.calibration.")}
             for path in (ROOT / "calibration").glob("*.py")}
    done: set[str] = set()

    def visit(module: str, stack: tuple[str, ...]) -> None:
        assert module not in stack, f"import cycle: {' -> '.join((*stack, module))}"
        if module not in done:
            for child in graph.get(module, ()):
                visit(child, (*stack, module))
            done.add(module)

    for module in graph:
        visit(module, ())


def test_torch_dtypes_match_the_precision_table() -> None:
    """calibrate's torch dtypes have the simulator's precision names and activation widths."""
    from pipescope.calibration.calibrate import DTYPES
    from pipescope.simulator.models import PRECISIONS

    assert DTYPES.keys() == PRECISIONS.keys()
    for name, dtype in DTYPES.items():
        assert torch.empty(0, dtype=dtype).element_size() == PRECISIONS[name].activation_bytes


def test_bus_bandwidth_factors_and_line_fit_follow_nccl_tests() -> None:
    """busbw = algbw * 2(n-1)/n for all-reduce, (n-1)/n for gathers; the fit recovers latency and bandwidth."""
    assert commfit.bandwidths("all_reduce", 4, 1000, 10) == (100.0, 150.0)
    assert commfit.bus_factor("all_gather", 8) == commfit.bus_factor("reduce_scatter", 8) == 7 / 8
    points = [(n, 5000 + n / 2.0) for n in (1 << 15, 1 << 16, 1 << 17)]  # 5 us + 2 bytes/ns
    latency, bandwidth = commfit.fit_line(points)
    assert latency == pytest.approx(5000) and bandwidth == pytest.approx(2e9)
    assert commfit.split_ranges([1 << 15, 1 << 16, 1 << 20, 1 << 27]) == [[1 << 15, 1 << 16], [1 << 20, 1 << 27]]


def test_a_failed_write_leaves_no_table_behind(tmp_path: Path) -> None:
    """A write that dies half-way (unserialisable value) leaves neither the table nor a temporary file."""
    with pytest.raises(Exception):  # noqa: B017 (whatever pyarrow raises)
        write_table(tmp_path, "timings", [{"component": object()}], parquet=True)
    assert list(tmp_path.iterdir()) == []


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_table(path: Path):  # noqa: ANN201 (a pandas DataFrame)
    pd = pytest.importorskip("pandas")
    return pd.read_parquet(path) if path.suffix == ".parquet" else pd.read_csv(path)


def test_comms_calibration_under_torchrun_with_gloo(profile: Calibrated, tmp_path: Path) -> None:
    """Two gloo ranks time all four collectives; bandwidths follow nccl-tests and the p2p fit times transfers."""
    out = Path(shutil.copytree(profile.out, tmp_path / "p"))
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                "--master-addr", "127.0.0.1", "--master-port", str(free_port())]
    args = ["-m", "pipescope.calibration.comms", "--out", str(out), "--min-bytes", "32KiB", "--max-bytes", "64KiB",
            "--warmup", "1", "--min-reps", "5", "--budget-s", "0.05"]
    done = subprocess.run(torchrun + args, cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    meta = json.loads((out / "comms.json").read_text())
    assert meta["backend"] == "gloo" and meta["world_size"] == 2 and meta["schema_version"] == 1
    assert meta["command"] == "torchrun --nproc-per-node 2 " + " ".join(args)  # not the module's file path
    table = read_table(out / meta["tables"]["comms"])
    assert set(table["collective"]) == {"all_reduce", "all_gather", "reduce_scatter", "p2p"}
    reduce, gather = table[table["collective"] == "all_reduce"], table[table["collective"] == "all_gather"]
    assert reduce["busbw_gbps"].tolist() == pytest.approx(reduce["algbw_gbps"].tolist())  # 2(n-1)/n = 1 for n = 2
    assert gather["busbw_gbps"].tolist() == pytest.approx((gather["algbw_gbps"] / 2).tolist())
    fit = read_table(out / meta["tables"]["comms_fit"])
    assert (fit["bandwidth"] > 0).all() and (fit["latency_ns"] > 0).all()  # a real latency (commfit.fit_latency)
    p2p = fit[fit["collective"] == "p2p"].iloc[0]
    expected = round(p2p["latency_ns"]) + math.ceil(65536 * 1e9 / p2p["bandwidth"])
    assert link_transfer_ns(65536, ProfiledCosts.load(out, MICROBATCH).p2p_link(65536)) == expected


def test_simulate_cli_runs_on_the_profile(profile: Calibrated, capsys: pytest.CaptureFixture) -> None:
    """`pipescope simulate --set costs.kind=profile` uses the profile; an unmeasured microbatch size is flagged."""
    from pipescope.experiments.cli import main
    base = ["simulate", "--json", "--stages", "2", "--microbatches", "4", "--set", "costs.kind=profile",
            "--set", f"costs.profile={profile.out}", "--set", "model.layers=4", "--set", "model.precision=fp32"]
    assert main([*base, "--set", f"model.microbatch_size={MICROBATCH}"]) == 0
    measured = json.loads(capsys.readouterr().out)
    costs = ProfiledCosts.load(profile.out, MICROBATCH)
    stages = [costs.stage_cost(s, 2, 1) for s in range(2)]
    steps = sum(c.optimizer_ns for c in stages)  # the profile's AdamW fit, once per stage
    assert steps > 0
    busy = sum(c.forward_ns + c.backward_ns for c in stages) * 4 + steps  # 1F1B's fused B: the profile's B rows
    assert sum(d["busy_s"] for d in measured["per_device"]) == pytest.approx(busy / 1e9)
    (note,) = measured["warnings"]  # a CPU profile without comms: its transfers cross the cluster's GPU links
    assert note.startswith("costs.profile: measured on a CPU (") and measured["mfu"] is None
    assert main([*base, "--set", "model.microbatch_size=8"]) == 0
    assert any("outside the measured 2..4" in w for w in json.loads(capsys.readouterr().out)["warnings"])
    assert main([*base, "--set", "costs.profile=/nonexistent"]) == 2
    assert "costs.profile: '/nonexistent'" in capsys.readouterr().err


def test_the_profiles_model_is_the_runs_model(profile: Calibrated) -> None:
    """With no model keys, a profile run simulates and reports the profiled shape, not the default preset's; a preset
    or dimension that contradicts the profile is a one-line error naming the key."""
    from pipescope.config import ConfigError, load_config
    from pipescope.runner import run
    base = ["costs.kind=profile", f"costs.profile={profile.out}", "schedule.stages=2", "schedule.microbatches=4"]
    model = run(load_config(None, base)).config.model
    assert (model.hidden, model.heads, model.vocab, model.layers, model.seq) == (
        SHAPE["hidden"], SHAPE["heads"], SHAPE["vocab"], SHAPE["layers"], SHAPE["seq"])
    assert model.precision == "fp32" and model.label.startswith("gpt-1.3b with") is False
    for extra, key in ((["model.preset=gpt-1.3b"], "model.hidden: model.preset 'gpt-1.3b' has 2048"),
                       (["model.vocab=100"], "model.vocab: got 100, but the profile"),
                       (["model.preset=llama3-8b"], "model.family: got llama under costs.kind profile, expected gpt")):
        with pytest.raises(ConfigError, match=key) as err:
            run(load_config(None, base + extra))
        assert "\n" not in str(err.value)
    assert run(load_config(None, [*base, "model.layers=8"])).config.model.layers == 8  # layers may differ
