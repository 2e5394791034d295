"""Summary numbers of a topology graph (GPUs, links, injection and bisection bandwidth) and a drawing of it
(docs/topologies.md defines each number)."""

from __future__ import annotations

import io
import math
import os
from collections import Counter

import networkx as nx

from pipescope.simulator.readers.files import write_atomic
from pipescope.topologies.graphs import SWITCH_KINDS

DRAW_SUFFIXES = (".png", ".svg", ".pdf")
MAX_DRAWN_SERVERS = 8  # more servers than this are unreadable side by side; the title says the drawing is cut
MAX_DRAWN_SPINES = 16
MAX_LABELLED = 120  # vertices drawn with their names; above this the labels overlap
ROWS = {"gpu": 0, "nvswitch": 1, "pcie": 2, "cpu": 3, "nic": 4, "leaf": 6, "spine": 7}  # bottom to top
NODE_STYLE = {"gpu": ("s", "#76b900"), "nvswitch": ("h", "#1f77b4"), "pcie": ("D", "#9467bd"),
              "cpu": ("8", "#7f7f7f"), "nic": ("^", "#ff7f0e"), "leaf": ("p", "#d62728"), "spine": ("*", "#8c564b")}
EDGE_COLOURS = {"nvlink": "#2ca02c", "nvswitch": "#1f77b4", "pcie": "#9467bd", "nic": "#ff7f0e", "fabric": "#d62728"}


def gpus_by_rank(graph: nx.DiGraph) -> list[str]:
    return [v for _, v in sorted((d["rank"], v) for v, d in graph.nodes(data=True) if d["kind"] == "gpu")]


def summarize(graph: nx.DiGraph) -> dict:
    """Counts and bandwidths (bytes/s, per direction) of a valid topology graph.

    ``gpu_injection_bandwidth`` is the smallest, over GPUs, of what a GPU can send at once (``gpu_injection``);
    ``network_injection_bandwidth`` is the NICs' line rate over the GPUs;
    ``bisection_bandwidth`` is the minimum cut from the first half of the ranks to the second (None below 2 GPUs).
    """
    roles = Counter(d["kind"] for _, d in graph.nodes(data=True))
    gpus = gpus_by_rank(graph)
    network = sum(d["bandwidth"] for a, _, d in graph.edges(data=True)
                  if d["kind"] == "nic" and graph.nodes[a]["kind"] == "nic")
    return {
        "name": graph.graph["name"], "device": graph.graph["device"], "nodes": graph.graph["nodes"],
        "gpus_per_node": graph.graph["gpus_per_node"], "gpus": len(gpus), "fabric": graph.graph.get("fabric"),
        "oversubscription": graph.graph.get("oversubscription", 1.0), "memory_bytes": graph.graph.get("memory_bytes"),
        "switches": sum(roles[k] for k in SWITCH_KINDS), "nics": roles["nic"], "links": graph.number_of_edges() // 2,
        "gpu_injection_bandwidth": min(gpu_injection(graph, g) for g in gpus),
        "network_injection_bandwidth": network / len(gpus),
        "bisection_bandwidth": bisection_bandwidth(graph, gpus),
    }


def gpu_injection(graph: nx.DiGraph, gpu: str) -> float:
    """Bytes/s a GPU can send at once: its NVLink or NVSwitch links, plus its one PCIe interface once. A GPU's PCIe
    edges (to its PCIe switch, and on rail machines to its NIC through that switch) share that one x16 port, so
    adding them would count it twice."""
    edges = list(graph.out_edges(gpu, data=True))
    pcie = [d["bandwidth"] for _, _, d in edges if d["kind"] == "pcie"]
    return sum(d["bandwidth"] for _, _, d in edges if d["kind"] != "pcie") + max(pcie, default=0.0)


def bisection_bandwidth(graph: nx.DiGraph, gpus: list[str] | None = None) -> float | None:
    """Max flow (= min cut) from ranks ``[0, N/2)`` to ``[N/2, N)`` with edge bandwidth as capacity."""
    gpus = gpus_by_rank(graph) if gpus is None else gpus
    if len(gpus) < 2:
        return None
    source, sink = ("super", "source"), ("super", "sink")  # tuples: no clash with the string node ids
    flow = nx.DiGraph()
    flow.add_weighted_edges_from(graph.edges(data="bandwidth"), weight="bandwidth")
    half = len(gpus) // 2
    flow.add_edges_from((source, g) for g in gpus[:half])  # no capacity attribute: unbounded
    flow.add_edges_from((g, sink) for g in gpus[half:])
    return float(nx.minimum_cut_value(flow, source, sink, capacity="bandwidth"))


def _shown(graph: nx.DiGraph) -> tuple[list[str], str]:
    """The vertices to draw (the first servers, the leaves they use, some spines) and a note when that is a cut."""
    servers = min(graph.graph["nodes"], MAX_DRAWN_SERVERS)
    inside = [v for v, d in graph.nodes(data=True) if 0 <= d["node"] < servers]
    leaves = sorted({b for a in inside for b in graph.adj[a] if graph.nodes[b]["kind"] == "leaf"}, key=_index)
    spines = sorted({b for a in leaves for b in graph.adj[a] if graph.nodes[b]["kind"] == "spine"}, key=_index)
    all_leaves = sum(1 for _, d in graph.nodes(data=True) if d["kind"] == "leaf")
    notes = []
    if servers < graph.graph["nodes"]:
        notes.append(f"servers 0-{servers - 1} of {graph.graph['nodes']}")
    if len(leaves) < all_leaves:
        notes.append(f"{len(leaves)} of {all_leaves} leaves")
    if len(spines) > MAX_DRAWN_SPINES:
        notes.append(f"{MAX_DRAWN_SPINES} of {len(spines)} spines")
    note = f" (cut: showing {', '.join(notes)})" if notes else ""
    return inside + leaves + spines[:MAX_DRAWN_SPINES], note


def _index(vertex: str) -> tuple[int, str]:
    """Sort key: the number a switch id ends with (``leaf10`` after ``leaf9``)."""
    digits = vertex[len(vertex.rstrip("0123456789")):]
    return (int(digits) if digits else -1, vertex)


def _layout(graph: nx.DiGraph, vertices: list[str]) -> dict[str, tuple[float, float]]:
    """Servers side by side, each in rows by kind (GPUs at the bottom); the fabric in rows above all of them."""
    rows: dict[tuple[int, str], list[str]] = {}
    for v in vertices:
        rows.setdefault((graph.nodes[v]["node"], graph.nodes[v]["kind"]), []).append(v)
    servers = sorted({home for home, _ in rows if home >= 0})
    width = max((len(members) for (home, _), members in rows.items() if home >= 0), default=1) + 1
    total = max(width * len(servers), 1)
    pos = {}
    for (home, role), members in rows.items():
        left, span = (servers.index(home) * width, width - 1) if home >= 0 else (0, total)
        for i, v in enumerate(members):
            pos[v] = (left + (i + 0.5) * span / len(members), ROWS[role])
    return pos


def draw(graph: nx.DiGraph, path: str | os.PathLike, title: str | None = None) -> None:
    """Draw ``graph`` to a PNG, SVG or PDF (by suffix), atomically: GPUs, switches and NICs by shape and colour,
    links coloured by kind and as wide as the log of their bandwidth; large graphs are cut (the title says so)."""
    name = os.fspath(path)
    suffix = os.path.splitext(name)[1].lower()
    if suffix not in DRAW_SUFFIXES:
        raise ValueError(f"draw: got {name!r}, expected a file name ending in {', '.join(DRAW_SUFFIXES)}")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    vertices, note = _shown(graph)
    pos = _layout(graph, vertices)
    servers = len({graph.nodes[v]["node"] for v in vertices} - {-1})
    fig, ax = plt.subplots(figsize=(min(max(2.5 * servers + 2, 9), 28), 7))
    sub = graph.subgraph(vertices)
    links = [(a, b, d) for a, b, d in sub.edges(data=True) if a < b]  # one line per physical link
    for role, colour in EDGE_COLOURS.items():
        for same_row in (False, True):  # links within a row (NVLink between GPUs) are drawn as arcs to be seen
            chosen = [(a, b, d["bandwidth"]) for a, b, d in links
                      if d["kind"] == role and (pos[a][1] == pos[b][1]) == same_row]
            arcs = {"arrows": True, "arrowstyle": "-", "node_size": 0, "connectionstyle": "arc3,rad=0.3"}
            if chosen:
                nx.draw_networkx_edges(sub, pos, edgelist=[(a, b) for a, b, _ in chosen], edge_color=colour, ax=ax,
                                       width=[0.6 + 1.2 * math.log10(max(bw, 1e9) / 1e9) for *_, bw in chosen],
                                       alpha=0.7, **(arcs if same_row else {"arrows": False}))
    for role, (marker, colour) in NODE_STYLE.items():
        members = [v for v in vertices if graph.nodes[v]["kind"] == role]
        if members:
            nx.draw_networkx_nodes(sub, pos, nodelist=members, node_shape=marker, node_color=colour, ax=ax,
                                   node_size=260 if len(vertices) <= MAX_LABELLED else 60)
    if len(vertices) <= MAX_LABELLED:
        nx.draw_networkx_labels(sub, pos, labels={v: v.split(".")[-1] for v in vertices}, font_size=6, ax=ax)
    present = {d["kind"] for _, d in sub.nodes(data=True)}, {d["kind"] for *_, d in links}
    handles = [Line2D([], [], marker=m, color=c, linestyle="", label=r) for r, (m, c) in NODE_STYLE.items()
               if r in present[0]]
    handles += [Line2D([], [], color=c, label=f"{r} link") for r, c in EDGE_COLOURS.items() if r in present[1]]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    g = graph.graph
    ax.set_title(title or f"{g['name']} x {g['nodes']} ({g['device']}, {g.get('fabric', 'no')} fabric){note}")
    ax.axis("off")
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format=suffix[1:], dpi=150)
    plt.close(fig)
    write_atomic(name, buffer.getvalue())
