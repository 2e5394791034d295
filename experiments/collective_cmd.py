"""``pipescope collective``: one collective on an idle cluster, timed by the flow model (or a comms profile's fit),
reported in nccl-tests' conventions (docs/network.md)."""

from __future__ import annotations

import argparse
import json
import re
import sys

from pipescope.calibration.commfit import bus_factor
from pipescope.experiments.cli import as_flag, choice_flag, integer_flag
from pipescope.experiments.topology_cmd import CLUSTER_FLAGS, OVERSUBSCRIPTION, decimal_flag
from pipescope.simulator.ir import ActionKind
from pipescope.simulator.routed import RoutedNetwork, time_alone
from pipescope.simulator.readers.units import parse_size, short_repr

OPS = {"all_reduce": ActionKind.ALL_REDUCE, "all_gather": ActionKind.ALL_GATHER,
       "reduce_scatter": ActionKind.REDUCE_SCATTER, "broadcast": ActionKind.BROADCAST}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("collective", help="time one collective on an idle cluster (nccl-tests' algbw and busbw)",
                       description="Time one collective over some GPUs of a topology with nothing else running, as "
                       "the simulator prices it: routed flows with fair sharing, the algorithm chosen per size as "
                       "NCCL's tuner does (or forced). Sizes follow nccl-tests: --bytes is the whole buffer.")
    p.add_argument("--topology", default="dgx-h100", help="built-in machine or a YAML/GraphML file (default dgx-h100; "
                   "see 'pipescope topology')")
    p.add_argument("--nodes", default="1", help="servers (default 1)")
    p.add_argument("--fabric", help="rail or fat-tree (default: the machine's)")
    p.add_argument("--oversubscription", help="fat-tree leaf uplink oversubscription >= 1 (default 1)")
    p.add_argument("--op", default="all_reduce", help=f"one of {', '.join(OPS)} (default all_reduce)")
    p.add_argument("--bytes", default="1GiB", help="buffer size, e.g. 1GiB, 64MB, 4096 (default 1GiB)")
    p.add_argument("--ranks", default=None, help="GPU ranks in ring order: 0-7, 0,8,16,24 or 0-3,8-11 "
                   "(default: every GPU)")
    p.add_argument("--algorithm", default="auto", help="auto (the fastest, as NCCL picks), ring, tree or "
                   "hierarchical")
    p.add_argument("--seed", default="0", help="ECMP path choice (default 0)")
    p.add_argument("--profile", metavar="DIR", help="a 'pipescope calibrate-comms' folder: its fit of this op and "
                   "rank count when it measured one, else a ring of its fitted p2p links")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_collective)


def cmd_collective(args: argparse.Namespace) -> int:
    try:
        report = collective_report(args)
    except ValueError as err:
        print(f"pipescope: error: {as_flag(str(err), CLUSTER_FLAGS)}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report))
    else:
        print(f"{report['op']} of {report['bytes']:,} bytes over {len(report['ranks'])} GPUs of {report['topology']} "
              f"({report['algorithm']}): {report['time_s'] * 1e3:.3f} ms, algbw {report['algbw_GBps']:.1f} GB/s, "
              f"busbw {report['busbw_GBps']:.1f} GB/s")
    return 0


def collective_report(args: argparse.Namespace) -> dict:
    """time_s, algbw and busbw (GB/s, 1e9 bytes/s) of the collective the flags name."""
    from pipescope.topologies.cluster import gpu_nodes
    from pipescope.topologies.topology_io import load_topology

    op = choice_flag("--op", args.op, tuple(OPS))
    nbytes = _size(args.bytes)
    graph = load_topology(args.topology, integer_flag("--nodes", args.nodes, 1, 4096), args.fabric,
                          decimal_flag(args.oversubscription, "--oversubscription", OVERSUBSCRIPTION, float))
    gpus = gpu_nodes(graph)
    ranks = parse_ranks(args.ranks, len(gpus))
    if args.profile:
        seconds, algorithm = _profiled(args.profile, op, ranks, nbytes)
    else:
        network = RoutedNetwork(graph, [gpus[r] for r in ranks], integer_flag("--seed", args.seed, 0, 2**63 - 1),
                                choice_flag("--algorithm", args.algorithm, ("auto", "ring", "tree", "hierarchical")))
        members = list(range(len(ranks)))
        algorithm = network.collectives.choose(OPS[op], members, nbytes)[0]
        seconds = time_alone(network, collective=(OPS[op], members, nbytes))[0] / 1e9
    algbw = nbytes / seconds / 1e9 if seconds > 0 else float("inf")
    return {"op": op, "bytes": nbytes, "ranks": ranks, "topology": graph.graph.get("name", args.topology),
            "algorithm": algorithm, "time_s": seconds, "algbw_GBps": algbw,
            "busbw_GBps": algbw * bus_factor(op, len(ranks))}


def _profiled(profile: str, op: str, ranks: list[int], nbytes: int) -> tuple[float, str]:
    """(seconds, source) from a comms profile: its own fit of ``op`` at this world size, else a ring of p2p links."""
    import networkx as nx

    from pipescope.simulator.profiled import load_comms_fit

    try:
        fit, path = load_comms_fit(profile)
    except ValueError as err:  # ProfileError: its messages name costs.profile, the config key; here it is a flag
        raise ValueError(f"--profile: {str(err).removeprefix('costs.profile: ')}") from None
    n = len(ranks)
    rows = fit[(fit["collective"] == op) & (fit["world_size"] == n)].sort_values("lo_bytes")
    if rows.empty:
        rows = fit[fit["collective"] == "p2p"].sort_values("lo_bytes")
        if rows.empty:
            raise ValueError(f"--profile: {path!r} has no fit of {op} over {n} ranks and no p2p fit")
        row = _row(rows, nbytes)
        star = nx.DiGraph()  # every rank one fitted p2p link from the others: half the latency each way
        for r in range(n):
            for a, b in ((f"g{r}", "hub"), ("hub", f"g{r}")):
                star.add_edge(a, b, bandwidth=float(row["bandwidth"]), latency_ns=float(row["latency_ns"]) / 2)
        # the fitted latency is a measured transfer's, NCCL's own time included: no step time on top
        network = RoutedNetwork(star, [f"g{r}" for r in range(n)], algorithm="ring", step_ns=0)
        return time_alone(network, collective=(OPS[op], list(range(n)), nbytes))[0] / 1e9, "profile p2p ring"
    row = _row(rows, nbytes)
    return (float(row["latency_ns"]) + nbytes * 1e9 / float(row["bandwidth"])) / 1e9, f"profile fit ({n} ranks)"


def _row(rows, nbytes: int):
    below = rows[rows["lo_bytes"] <= nbytes]
    return below.iloc[-1] if not below.empty else rows.iloc[0]


def parse_ranks(text: str | None, gpus: int) -> list[int]:
    """``0-7``, ``0,8,16`` or ``0-3,8-11`` -> ranks in that order (None: all); ValueError naming --ranks."""
    if text is None:
        if gpus < 2:  # one GPU has no one to exchange with: its times would be 0 and its bandwidths infinite
            raise ValueError(f"--topology: got a cluster of {gpus} GPU, expected at least 2 (more --nodes, or a "
                             f"machine with more GPUs)")
        return list(range(gpus))
    ranks: list[int] = []
    for part in text.split(","):
        match = re.fullmatch(r"\s*([0-9]{1,6})\s*(?:-\s*([0-9]{1,6})\s*)?", part)
        if match is None:
            raise ValueError(f"--ranks: got {short_repr(text)}, expected ranks such as 0-7 or 0,8,16,24")
        low, high = int(match.group(1)), int(match.group(2) or match.group(1))
        if high < low:
            raise ValueError(f"--ranks: {part.strip()!r} runs backwards, expected low-high with low <= high")
        if high >= gpus:
            raise ValueError(f"--ranks: {part.strip()!r} is not within 0-{gpus - 1}, the GPUs of this topology")
        ranks += range(low, high + 1)
    seen: set[int] = set()
    twice = next((rank for rank in ranks if rank in seen or seen.add(rank)), None)  # set.add returns None
    if twice is not None:
        raise ValueError(f"--ranks: got {short_repr(text)}, which names rank {twice} twice; expected each rank once")
    if len(ranks) < 2:
        raise ValueError(f"--ranks: got {short_repr(text)}, expected at least 2 distinct ranks")
    return ranks


def _size(text: str) -> int:
    try:
        nbytes = parse_size(text)
    except ValueError:
        nbytes = -1  # the range below says what is expected: 0 is no size either
    if not 1 <= nbytes <= 1 << 50:
        raise ValueError(f"--bytes: got {short_repr(text)}, expected a size from 1 B to 1 PiB, such as 64MB or 1GiB")
    return nbytes
