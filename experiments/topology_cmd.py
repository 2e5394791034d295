"""``pipescope topology``: summarise, draw or save a machine or cluster graph (docs/topologies.md)."""

from __future__ import annotations

import argparse
import json
import re
import sys

from pipescope.experiments.cli import as_flag
from pipescope.topologies.graphs import FABRICS, MAX_NODES, MAX_OVERSUBSCRIPTION, topology_names
from pipescope.topologies.summary import DRAW_SUFFIXES, draw, summarize
from pipescope.topologies.topology_io import load_topology, save_topology

EXIT_USAGE = 2
SAVE_SUFFIXES = (".yaml", ".yml", ".graphml")


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``topology`` parser to the ``pipescope`` subcommands."""
    p = sub.add_parser(
        "topology", help="summarise, draw or save a machine or cluster graph",
        description="Build the graph of a machine (or NODES of them on a fabric) and print its GPUs, links, "
                    "per-GPU and network injection bandwidth and bisection bandwidth (docs/topologies.md).")
    p.add_argument("machine", metavar="NAME|FILE", help=f"a built-in machine ({', '.join(topology_names())}) or a "
                   "topology file: .yaml/.yml (one server, a full graph, or the old machine format) or .graphml")
    p.add_argument("--nodes", metavar="N", help=f"servers to join over the fabric (1 to {MAX_NODES}; default 1)")
    p.add_argument("--fabric", metavar="|".join(FABRICS), help="rail: NIC i of every server on leaf i, rails joined "
                   "by spines; fat-tree: leaves of 32 NICs, each joined to every spine (default: the machine's)")
    p.add_argument("--oversubscription", metavar="X", help="divide each leaf's uplink bandwidth by X (1 to "
                   f"{MAX_OVERSUBSCRIPTION:g}; default 1: non-blocking)")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object (bytes/s)")
    p.add_argument("--png", metavar="FILE", help=f"draw the graph to FILE ({', '.join(DRAW_SUFFIXES)}); large "
                   "clusters are cut to their first servers")
    p.add_argument("--save", metavar="FILE", help="write the full graph to FILE.yaml or FILE.graphml, which "
                   "'pipescope topology FILE' and cluster.topology read back")
    p.set_defaults(func=cmd_topology)


def _error(message: str) -> int:
    print(f"pipescope: error: {message}", file=sys.stderr)
    return EXIT_USAGE


# The config keys load_topology's errors name, and the flags of topology and collective that set them
CLUSTER_FLAGS = {"cluster.topology": "--topology", "cluster.nodes": "--nodes", "cluster.fabric": "--fabric",
                 "cluster.oversubscription": "--oversubscription"}
OVERSUBSCRIPTION = r"[0-9]{1,6}(\.[0-9]{1,6})?"  # plain decimal: no nan, inf, 1e3 or 1_0


def decimal_flag(text: str | None, flag: str, pattern: str, convert: type) -> int | float | None:
    """A plain decimal flag value (argparse's int/float would take ``1_6``, ``nan`` and ``inf``)."""
    if text is None:
        return None
    if not re.fullmatch(pattern, text):
        raise ValueError(f"{flag}: got {text[:60]!r}, expected a plain decimal number")
    return convert(text)


def cmd_topology(args: argparse.Namespace) -> int:
    """Print the summary (or JSON), then write --png and --save; exit 2 with one line on bad input."""
    try:
        nodes = decimal_flag(args.nodes, "--nodes", r"[0-9]{1,6}", int)
        ratio = decimal_flag(args.oversubscription, "--oversubscription", OVERSUBSCRIPTION, float)
        for flag, path, suffixes in (("--png", args.png, DRAW_SUFFIXES), ("--save", args.save, SAVE_SUFFIXES)):
            if path is not None and not path.lower().endswith(suffixes):
                raise ValueError(f"{flag}: got {path[:200]!r}, expected a file name ending in {', '.join(suffixes)}")
        graph = load_topology(args.machine, 1 if nodes is None else nodes, args.fabric, ratio)
        summary = summarize(graph)
        if args.png:
            _written("--png", lambda path: draw(graph, path), args.png)
        if args.save:
            _written("--save", lambda path: save_topology(graph, path), args.save)
    except ValueError as err:
        return _error(as_flag(str(err), {**CLUSTER_FLAGS, "cluster.topology": "NAME|FILE"}))
    print(json.dumps(summary) if args.json else table(summary))
    if not args.json:
        for label, path in (("drawing", args.png), ("graph", args.save)):
            if path:
                print(f"wrote {label}: {path}")
    return 0


def _written(flag: str, write, path: str) -> None:
    """``write(path)``; what the file cannot hold or where it cannot go, as one line naming ``flag``."""
    try:
        write(path)
    except ValueError as err:
        raise ValueError(f"{flag}: {err}") from None
    except OSError as err:
        raise ValueError(f"{flag}: cannot write {path[:200]!r} ({err.strerror}), expected a writable file name") \
            from None


def _gb(value: float | None) -> str:
    return "n/a" if value is None else f"{value / 1e9:,.1f} GB/s"


def table(summary: dict) -> str:
    """The summary as a short two-column table (bandwidths in GB/s, per direction)."""
    s = summary
    rows = [
        ("GPUs", f"{s['gpus']} ({s['nodes']} x {s['gpus_per_node']} {s['device']})"),
        ("NICs / switches", f"{s['nics']} / {s['switches']}"),
        ("links", f"{s['links']}"),
        ("per-GPU injection", f"{_gb(s['gpu_injection_bandwidth'])}  (NVLink + one PCIe port, smallest GPU)"),
        ("network injection", f"{_gb(s['network_injection_bandwidth'])} per GPU  (NIC line rate / GPUs)"),
        ("bisection", f"{_gb(s['bisection_bandwidth'])}  (min cut, first half of the ranks to the second)"),
    ]
    if s["memory_bytes"] is not None:
        rows.append(("device memory", f"{s['memory_bytes'] / 2**30:g} GiB (overrides the datasheet)"))
    head = f"{s['name']} x {s['nodes']}, {s['fabric']} fabric, oversubscription {s['oversubscription']:g}"
    return "\n".join([head, *(f"  {label:<19} {value}" for label, value in rows)])
