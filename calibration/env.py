"""What a profile records about where it was measured: device, versions, clocks, date, command."""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import shutil
import subprocess
import sys

import numpy
import pandas
import torch


def device_info(device: torch.device) -> dict:
    """Device type, name and count, plus clocks when readable (nvidia-smi on CUDA, /proc/cpuinfo on CPU)."""
    if device.type == "cuda":
        return {"type": "cuda", "name": torch.cuda.get_device_name(device), "count": torch.cuda.device_count(),
                "capability": list(torch.cuda.get_device_capability(device)), "clocks": gpu_clocks(device)}
    return {"type": "cpu", "name": cpu_name(), "count": 1, "logical_cores": os.cpu_count(), "clocks": cpu_clocks()}


def versions() -> dict:
    """Versions of everything that changes kernel timings."""
    nccl = None
    if torch.cuda.is_available() and hasattr(torch.cuda, "nccl"):
        try:
            nccl = ".".join(str(v) for v in torch.cuda.nccl.version())
        except (RuntimeError, AttributeError, TypeError):
            nccl = None
    return {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
            "nccl": nccl, "numpy": numpy.__version__, "pandas": pandas.__version__, "platform": platform.platform()}


def now_utc() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def command_line(argv: list[str] | None) -> str:
    """The command as the user typed it (shell-quoted), to run again: ``argv`` given in-process stands in for
    sys.argv. Under ``python -m`` sys.argv[0] is the module's file, so the module is named instead; under torchrun,
    with its ranks per node."""
    if argv is not None:
        return shlex.join(["pipescope", *argv])
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is None or not spec.name:  # a console script: its name is how it was typed
        return shlex.join([os.path.basename(sys.argv[0]), *sys.argv[1:]])
    ranks = os.environ.get("LOCAL_WORLD_SIZE")  # set by torchrun for every rank it starts
    launcher = ["torchrun", "--nproc-per-node", ranks] if ranks else ["python"]
    return shlex.join([*launcher, "-m", spec.name.removesuffix(".__main__"), *sys.argv[1:]])


def gpu_clocks(device: torch.device) -> dict | None:
    """SM and memory clocks (current and max, MHz) from nvidia-smi, or None where it is not available."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    fields = "clocks.sm,clocks.mem,clocks.max.sm,clocks.max.mem"
    try:
        query = [smi, f"--query-gpu={fields}", "--format=csv,noheader,nounits", "-i", str(device.index or 0)]
        out = subprocess.run(query, capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    values = [v.strip() for v in out.strip().split(",")]
    return dict(zip(["sm_mhz", "mem_mhz", "max_sm_mhz", "max_mem_mhz"], values, strict=False))


def cpu_name() -> str:
    for line in _cpuinfo():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def cpu_clocks() -> dict | None:
    """The first core's current clock (MHz) as /proc/cpuinfo reports it, or None."""
    for line in _cpuinfo():
        if line.startswith("cpu MHz"):
            return {"mhz": float(line.split(":", 1)[1])}
    return None


def _cpuinfo() -> list[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return f.read().splitlines()
    except OSError:
        return []
