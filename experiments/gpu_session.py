"""``python -m pipescope.experiments.gpu_session OUT``: what a lent GPU machine is for, in one command from a source
tree (docs/validation.md, "A GPU session").

First the GEMM sweep (``calibrate-gemms``: every (m, n, k) of ``--gemm-sizes``, bf16 on CUDA) into
``OUT/profiles/<device>/gemms``; then for each model the profile users simulate with (``calibrate``: bf16 on CUDA,
every microbatch size and vocabulary shard count) into ``OUT/profiles/<device>/<model>``, then ``validate``: every
stage timed on one GPU against the profile of the executor's own precision (fp32), and the pipeline too where there
is a GPU per stage device, its JSON report in ``OUT/validation/<device>/<model>.json``. Each step is a subprocess
with its output in ``OUT/logs``, so one that fails (say, out of memory) leaves the others; the exit code is 1 when
any failed. A GPU box has torch, numpy, pandas and pyarrow; ``validate`` also needs PyYAML, SimPy and tqdm, which
``make gpu-site`` puts in ``.gpu-site`` to carry there (they are pure Python).
"""

from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path

from pipescope.calibration.gemms import CPU_SIZES, DEFAULT_SIZES, MAX_SIZE
from pipescope.experiments.processes import run_in_group

MODELS = ("tiny", "gpt-355m", "gpt-1.3b", "gpt-2.2b", "gpt-3.8b")
# What validate needs beyond a GPU box's torch, numpy, pandas and pyarrow: distribution -> the names it imports as
CARRIED = {"pyyaml": ("yaml", "_yaml"), "simpy": ("simpy",), "tqdm": ("tqdm",)}
# validate's schedule per model: zb-h1 times F, I, W and the step of every stage; stages divide the layers
VALIDATION = {"tiny": ("zb-h1", 2, 4), **{m: ("zb-h1", 4, 8) for m in MODELS[1:]}}
ROOT = Path(__file__).resolve().parent.parent  # the source tree: `python -m pipescope...` runs from here


def device_name(device: str) -> str:
    """A folder name for the device: ``h100-80gb-hbm3`` for an "NVIDIA H100 80GB HBM3", ``cpu`` on CPU."""
    if device == "cpu":
        return "cpu"
    import torch
    return folder_name(torch.cuda.get_device_name(0))


def folder_name(gpu: str) -> str:
    """``h200`` for "NVIDIA H200": the name of a GPU's folder under ``calibration/profiles``."""
    return re.sub(r"[^a-z0-9]+", "-", gpu.lower().removeprefix("nvidia ")).strip("-")


def steps(models: list[str], device: str, out: Path, budget_s: str, iterations: str, gemms: bool = True,
          gemm_sizes: str | None = None) -> list[tuple[str, list[str]]]:
    """(name, pipescope arguments) of every step, in order: the GEMM sweep first (with ``gemms``; its sizes, or
    calibrate-gemms' default for the device), then each model's calibration and validation."""
    name = device_name(device)
    todo = []
    if gemms:
        sizes = ["--sizes", gemm_sizes] if gemm_sizes else []
        todo.append(("calibrate-gemms", ["calibrate-gemms", "--device", device, *sizes,
                                         "--out", str(out / "profiles" / name / "gemms")]))
    for model in models:
        schedule, stages, microbatches = VALIDATION[model]
        todo.append((f"calibrate-{model}", ["calibrate", "--model", model, "--device", device, "--budget-s", budget_s,
                                            "--out", str(out / "profiles" / name / model)]))
        todo.append((f"validate-{model}", ["validate", "--model", model, "--device", device, "--op-times", "stages",
                                           "--schedule", schedule, "--stages", str(stages), "--microbatches",
                                           str(microbatches), "--iterations", iterations, "--json"]))
    return todo


def run_step(name: str, args: list[str], out: Path, device: str, timeout_s: float) -> bool:
    """Run ``pipescope ARGS`` from the source tree, stopped after ``timeout_s`` (a hung step must not take the
    device's whole time); its output in OUT/logs (a validate's stdout is its report)."""
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    print(f"gpu_session: {name} ...", file=sys.stderr, flush=True)
    with open(logs / f"{name}.out", "w") as stdout, open(logs / f"{name}.err", "w") as stderr:
        done = run_in_group([sys.executable, "-m", "pipescope.experiments.cli", *args], timeout_s, cwd=ROOT,
                            stdout=stdout, stderr=stderr, env={**os.environ, "OMP_NUM_THREADS": "1"})
        if done is None:
            print(f"gpu_session: stopped after {timeout_s:g} s (--step-timeout)", file=stderr, flush=True)
        code = 124 if done is None else done.returncode
    if code == 0 and args[0] == "validate":
        report = out / "validation" / device_name(device) / f"{name.removeprefix('validate-')}.json"
        report.parent.mkdir(parents=True, exist_ok=True)
        report.write_text((logs / f"{name}.out").read_text())
    status = "ok" if code == 0 else f"failed (exit {code}): {_last_line(logs / f'{name}.err')}"
    print(f"gpu_session: {name} {status} in {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
    return code == 0


def _check_device(device: str) -> None:
    import torch
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device: got 'cuda', but torch sees no CUDA device here; expected cpu (to rehearse)")


def _last_line(path: Path) -> str:
    lines = path.read_text().strip().splitlines()
    return lines[-1] if lines else "no output"


def main(argv: list[str] | None = None) -> int:
    from pipescope.calibration.args import MAX_BUDGET_S, int_list, number
    from pipescope.experiments.cli import Parser, integer_flag, usage_error
    parser = Parser(prog="python -m pipescope.experiments.gpu_session",
                    description=__doc__.split("\n\n")[1].replace("\n", " "))
    parser.add_argument("out", type=Path, help="folder for profiles/, validation/ and logs/")
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS[:3]),
                        help="presets (default: tiny gpt-355m gpt-1.3b, which fit one 10-minute command)")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cuda (default), or cpu to rehearse")
    parser.add_argument("--budget-s", default="2.0", help="calibrate's wall-time budget per op in seconds (default 2)")
    parser.add_argument("--iterations", default="10", help="validate's measured iterations (default 10)")
    parser.add_argument("--gemm-sizes", help="calibrate-gemms' --sizes, every (m, n, k) of them timed first "
                        f"(default {DEFAULT_SIZES} on cuda, {CPU_SIZES} on cpu)")
    parser.add_argument("--no-gemms", action="store_true", help="skip the GEMM sweep (a second command on the box)")
    parser.add_argument("--step-timeout", default="540", help="seconds before a step is stopped (default 540: "
                        "the device tool gives a command 600)")
    args = parser.parse_args(argv)
    try:  # checked here, not once per step
        number("--budget-s", args.budget_s, 0.0, MAX_BUDGET_S)
        integer_flag("--iterations", args.iterations, 1, 100)
        timeout_s = number("--step-timeout", args.step_timeout, 0.0, MAX_BUDGET_S)
        if args.gemm_sizes is not None:
            int_list("--gemm-sizes", args.gemm_sizes, "1024,4096", high=MAX_SIZE)
        _check_device(args.device)
    except ValueError as err:
        return usage_error(str(err))
    out = args.out.resolve()  # the steps run from the source tree
    try:
        results = [run_step(name, step, out, args.device, timeout_s)
                   for name, step in steps(args.models, args.device, out, args.budget_s, args.iterations,
                                           not args.no_gemms, args.gemm_sizes)]
    except KeyboardInterrupt:  # the running step is stopped already (run_in_group)
        print("gpu_session: interrupted", file=sys.stderr)
        return 130
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
