"""Loading, checking and saving topologies: built-in names, YAML (one server, a full graph, or the old machine
format) and GraphML (docs/topologies.md has the formats and the limits).

Files are treated as hostile: YAML goes through ``safe_yaml`` (no aliases, 1 MiB), GraphML is refused above 8 MiB
or with a DOCTYPE/ENTITY declaration before the XML parser sees it, and every graph passes ``validate``, whose
errors are one line naming the file and the node or edge.
"""

from __future__ import annotations

import functools
import math
import os
import re
import xml.etree.ElementTree as ET

import networkx as nx
import yaml

from pipescope.simulator.readers.files import read_small_text, write_atomic
from pipescope.simulator.readers.safe_yaml import MAX_YAML_BYTES, YamlError, read_yaml_file
from pipescope.simulator.readers.units import parse_bandwidth, parse_size, parse_time, short_repr
from pipescope.topologies.devices import DEVICES
from pipescope.topologies.graphs import (
    BANDWIDTH_RANGE, EDGE_ENDS, EDGE_KINDS, FABRICS, MAX_GPUS_PER_NODE, MAX_GRAPH_EDGES, MAX_GRAPH_VERTICES,
    MAX_LATENCY_NS, BUILTINS, MAX_NODES, MAX_OVERSUBSCRIPTION, NODE_KINDS, SERVER_LINK_KINDS, SERVER_PART_KINDS,
    Link, Server, build_cluster, builtin, fabric_size, topology_names,
)

KEY = "cluster.topology"
MAX_GRAPHML_BYTES = 8 << 20  # about 40,000 directed edges as networkx writes them
MAX_SERVER_PARTS = 1024  # switches, CPUs and NICs in one server file
MAX_SERVER_LINKS = 16_384
MAX_MEMORY_BYTES = 1 << 50
ID = re.compile(r"[A-Za-z][A-Za-z0-9_.:-]{0,99}")  # a letter first, so no id reads back from YAML as a number
GRAPH_ATTRS = ("name", "device", "gpus_per_node", "nodes", "fabric", "oversubscription", "memory_bytes")
NODE_ATTRS = ("kind", "node", "rank")
FABRIC_ROLES = ("leaf", "spine")  # node kinds outside any server (node -1)
Source = Server | nx.DiGraph


def load_topology(name_or_path: str, nodes: int = 1, fabric: str | None = None,
                  oversubscription: float | None = None) -> nx.DiGraph:
    """The graph of a built-in machine (``topology_names()``) or a file, ``nodes`` servers on ``fabric``.

    ``fabric`` is ``rail`` or ``fat-tree`` (None: the machine's default); ``oversubscription`` >= 1 divides each
    leaf's uplink bandwidth (None: 1). A full graph (GraphML, or YAML with ``vertices``) holds its own fabric, so it
    takes neither; ``nodes`` must then be 1 or its own count.

    Raises:
        ValueError: one line naming the key, the file and the offending entry, node or edge.
    """
    graph = shared_topology(name_or_path, nodes, fabric, oversubscription)
    return graph.copy() if nx.is_frozen(graph) else graph


def shared_topology(name_or_path: str, nodes: int = 1, fabric: str | None = None,
                    oversubscription: float | None = None) -> nx.DiGraph:
    """``load_topology``'s graph for a caller that only reads it: a built-in machine's is the process's one, frozen
    (``nx.freeze``: adding or removing a node or an edge raises), not a copy. Copying a 128-server graph took half
    of the planner's screening of each candidate on it; what changes a graph (``faults.apply_link_faults``) copies
    it first."""
    _check_arguments(nodes, fabric, oversubscription)
    if isinstance(name_or_path, str) and builtin(name_or_path) is not None:
        return _built_in_cluster(name_or_path, nodes, fabric, oversubscription)
    return _load(name_or_path, nodes, fabric, oversubscription)


@functools.lru_cache(maxsize=16)
def _built_in_cluster(name: str, nodes: int, fabric: str | None, oversubscription: float | None) -> nx.DiGraph:
    """A built-in machine's cluster, built and validated once per process (the planner builds thousands of runs
    on one cluster), frozen: ``load_topology`` hands out copies, and ``shared_topology`` the graph to read."""
    return nx.freeze(_load(name, nodes, fabric, oversubscription))


def _load(name_or_path: str, nodes: int, fabric: str | None, oversubscription: float | None) -> nx.DiGraph:
    source, where = _read(name_or_path)
    if isinstance(source, nx.DiGraph):
        if fabric is not None or oversubscription is not None or nodes not in (1, source.graph["nodes"]):
            raise ValueError(f"{where}: a full graph of {source.graph['nodes']} nodes with its own fabric, expected "
                             f"no cluster.nodes other than {source.graph['nodes']}, no fabric or oversubscription")
        return source
    fabric = fabric or source.default_fabric
    _check_buildable(source, nodes, fabric, where)
    graph = build_cluster(source, nodes, fabric, 1.0 if oversubscription is None else float(oversubscription))
    if builtin(name_or_path) is None:  # a machine file's server; the built-in ones' clusters are checked in tests
        validate(graph, where)
    return graph


def machine_device(name_or_path: str) -> str:
    """The device key (``DEVICES``) of a built-in machine or a file, without building a cluster."""
    source, _ = _read(name_or_path)
    return source.device if isinstance(source, Server) else source.graph["device"]


def save_topology(graph: nx.DiGraph, path: str | os.PathLike) -> None:
    """Write ``graph`` as a full-graph YAML (``.yaml``/``.yml``) or GraphML (``.graphml``) file that
    ``load_topology`` reads back equal. Only the contract's attributes are written.

    Raises:
        ValueError: an invalid graph, another suffix, or a file too big to load back.
        OSError: the file cannot be written (naming it).
    """
    name = os.fspath(path)
    where = f"save_topology: {short_repr(name, 400)}"
    validate(graph, where)
    clean = _contract_copy(graph)
    if name.lower().endswith((".yaml", ".yml")):
        text, limit = _to_yaml(clean), MAX_YAML_BYTES
    elif name.lower().endswith(".graphml"):
        text, limit = "\n".join(nx.generate_graphml(clean)) + "\n", MAX_GRAPHML_BYTES
    else:
        raise ValueError(f"{where}: expected a file name ending in .yaml, .yml or .graphml")
    if len(text.encode()) > limit:
        other = f" (or GraphML, whose limit is {MAX_GRAPHML_BYTES:,})" if limit < MAX_GRAPHML_BYTES else ""
        raise ValueError(f"{where}: {len(text.encode()):,} bytes, more than the {limit:,} a topology file may hold; "
                         f"save fewer nodes{other}")
    write_atomic(name, text)


def _check_arguments(nodes: object, fabric: object, oversubscription: object) -> None:
    if type(nodes) is not int or not 1 <= nodes <= MAX_NODES:
        raise ValueError(f"cluster.nodes: got {short_repr(nodes)}, expected an integer from 1 to {MAX_NODES:,}")
    if fabric is not None and fabric not in FABRICS:
        raise ValueError(f"cluster.fabric: got {short_repr(fabric)}, expected one of {', '.join(FABRICS)}")
    if oversubscription is not None and not (_is_number(oversubscription)
                                             and 1 <= oversubscription <= MAX_OVERSUBSCRIPTION):
        raise ValueError(f"cluster.oversubscription: got {short_repr(oversubscription)}, expected a number from 1 "
                         f"to {MAX_OVERSUBSCRIPTION:g}")


def _check_buildable(server: Server, nodes: int, fabric: str, where: str) -> None:
    """Refuse a cluster that cannot be joined or would exceed the graph caps, before building it."""
    if nodes > 1 and not server.nics:
        raise ValueError(f"{where}: {server.name} has no NIC, so {nodes} nodes cannot be joined; expected "
                         f"cluster.nodes 1 or a part of kind nic")
    leaves, spines = fabric_size(server, nodes, fabric)
    vertices = nodes * (server.gpus + len(server.parts)) + leaves + spines
    edges = 2 * (nodes * (len(server.links) + len(server.nics)) + leaves * spines)
    if vertices > MAX_GRAPH_VERTICES or edges > MAX_GRAPH_EDGES:
        raise ValueError(f"cluster.nodes: {nodes} nodes of {server.name} make {vertices:,} vertices and {edges:,} "
                         f"edges, expected at most {MAX_GRAPH_VERTICES:,} and {MAX_GRAPH_EDGES:,}")


def _read(name_or_path: object) -> tuple[Source, str]:
    """(a Server, or a validated full graph; the ``where`` prefix of its messages)."""
    if not isinstance(name_or_path, str):
        raise ValueError(f"{KEY}: got {short_repr(name_or_path)}, expected a machine name or a file path")
    server = builtin(name_or_path)
    if server is not None:
        return server, f"{KEY}: {name_or_path!r}"
    where = f"{KEY}: {short_repr(name_or_path, 400)}"
    lowered = name_or_path.lower()
    is_yaml, is_graphml = lowered.endswith((".yaml", ".yml")), lowered.endswith(".graphml")
    if not (is_yaml or is_graphml):
        raise ValueError(f"{KEY}: got {short_repr(name_or_path)}, expected a .yaml, .yml or .graphml file or one of "
                         f"{', '.join(topology_names())}")
    if not os.path.isfile(name_or_path):
        raise ValueError(f"{where} is not a file, expected a readable {'YAML' if is_yaml else 'GraphML'} file")
    if is_graphml:
        return _read_graphml(name_or_path, where), where
    try:
        raw = read_yaml_file(name_or_path)
    except YamlError as err:
        raise ValueError(f"{KEY}: {err}") from None
    stem = os.path.splitext(os.path.basename(name_or_path))[0]
    return _from_yaml(raw, where, stem), where


# --- YAML: one server, a full graph, or the old machine format ---

def _from_yaml(raw: object, where: str, stem: str) -> Source:
    if isinstance(raw, dict) and "intra_node" in raw:
        return _old_machine(raw, where, stem)
    if isinstance(raw, dict) and "vertices" in raw:
        return _full_graph(raw, where)
    return _server(raw, where, stem)


def _fields(raw: object, what: str, required: tuple[str, ...], optional: tuple[str, ...] = ()) -> dict:
    """``raw`` if it is a mapping with all of ``required`` and nothing beyond ``optional``."""
    keys = ", ".join(required + optional)
    if not isinstance(raw, dict):
        raise ValueError(f"{what}: got {short_repr(raw)}, expected a mapping with keys {keys}")
    missing = [k for k in required if k not in raw]
    unknown = [k for k in raw if k not in required + optional]
    if missing:
        raise ValueError(f"{what}: {missing[0]} is missing, expected keys {keys}")
    if unknown:
        raise ValueError(f"{what}: {short_repr(unknown[0])} is not a key, expected keys {keys}")
    return raw


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _bandwidth(value: object, what: str) -> float:
    """Bytes/s from a number or ``'450GB/s'``, within 1 MB/s to 1 PB/s."""
    low, high = BANDWIDTH_RANGE
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        try:
            value = parse_bandwidth(value)
        except ValueError as err:
            raise ValueError(f"{what}: {err}") from None
    if not (_is_number(value) and low <= value <= high):
        raise ValueError(f"{what}: got {short_repr(value)}, expected 1MB/s to 1PB/s")
    return float(value)


def _latency_ns(entry: dict, what: str) -> float:
    """Nanoseconds from ``latency`` (a time: ``'2us'``, or seconds) or ``latency_ns`` (a number), 0 to 1 s."""
    if ("latency" in entry) == ("latency_ns" in entry):
        raise ValueError(f"{what}: expected one of latency (a time such as '2us') or latency_ns, got "
                         f"{'both' if 'latency' in entry else 'neither'}")
    if "latency" in entry:
        try:
            value = round(parse_time(entry["latency"]) * 1e9, 6)  # '500ns' is 500.00000000000006 ns unrounded
        except ValueError as err:
            raise ValueError(f"{what}: latency: {err}") from None
    else:
        value = entry["latency_ns"]
    if not (_is_number(value) and 0 <= value <= MAX_LATENCY_NS):
        key = "latency" if "latency" in entry else "latency_ns"
        raise ValueError(f"{what}: {key}: got {short_repr(entry[key])}, expected 0 to 1 s")
    return float(value)


def _integer(value: object, what: str, low: int, high: int) -> int:
    if type(value) is not int or not low <= value <= high:
        raise ValueError(f"{what}: got {short_repr(value)}, expected an integer from {low:,} to {high:,}")
    return value


def _choice(value: object, what: str, choices: tuple[str, ...] | dict) -> str:
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{what}: got {short_repr(value)}, expected one of {', '.join(choices)}")
    return value


def _identifier(value: object, what: str) -> str:
    if not isinstance(value, str) or not ID.fullmatch(value):
        raise ValueError(f"{what}: got {short_repr(value)}, expected a name of letters, digits and _.:- starting "
                         f"with a letter (at most 100)")
    return value


def _link(entry: object, what: str, declared: dict[str, str], kinds: tuple[str, ...]) -> Link:
    """One ``edges`` entry: a physical link between two declared nodes, with an optional differing ``reverse``."""
    entry = _fields(entry, what, ("a", "b", "kind", "bandwidth"), ("latency", "latency_ns", "reverse", "efficiency"))
    for end in ("a", "b"):
        if not isinstance(entry[end], str) or entry[end] not in declared:
            raise ValueError(f"{what}: {end}: {short_repr(entry[end])} is not a declared node (dangling edge)")
    if entry["a"] == entry["b"]:
        raise ValueError(f"{what}: a and b are both {entry['a']!r}, expected a link between two nodes")
    role = _choice(entry["kind"], f"{what}: kind", kinds)
    if declared[entry["a"]] and declared[entry["b"]]:  # a server's parts; a full graph's are checked by validate
        _check_ends(role, declared[entry["a"]], declared[entry["b"]], what)
    bandwidth, latency = _bandwidth(entry["bandwidth"], f"{what}: bandwidth"), _latency_ns(entry, what)
    reverse_bw = reverse_ns = None
    if "reverse" in entry:
        back = _fields(entry["reverse"], f"{what}: reverse", ("bandwidth",), ("latency", "latency_ns"))
        reverse_bw = _bandwidth(back["bandwidth"], f"{what}: reverse: bandwidth")
        # the way back's latency is the link's unless it names its own
        reverse_ns = _latency_ns(back, f"{what}: reverse") if {"latency", "latency_ns"} & set(back) else latency
    efficiency = _efficiency(entry.get("efficiency", 1.0), f"{what}: efficiency")
    return Link(entry["a"], entry["b"], role, bandwidth, latency, reverse_bw, reverse_ns, efficiency)


def _efficiency(value: object, what: str) -> float:
    """A fraction of a line rate: a number in (0, 1]."""
    if not (_is_number(value) and 0 < value <= 1):
        raise ValueError(f"{what}: got {short_repr(value)}, expected a fraction of the line rate in (0, 1]")
    return float(value)


def _links(raw: object, where: str, declared: dict[str, str], kinds: tuple[str, ...], cap: int) -> list[Link]:
    """The ``edges`` list, each physical link once."""
    if not isinstance(raw, list) or len(raw) > cap:
        raise ValueError(f"{where}: edges: got {short_repr(raw)}, expected a list of at most {cap:,} links")
    links, seen = [], {}
    for i, entry in enumerate(raw):
        link = _link(entry, f"{where}: edges[{i}]", declared, kinds)
        pair = frozenset((link.a, link.b))
        if pair in seen:
            raise ValueError(f"{where}: edges[{i}]: the link {link.a!r}-{link.b!r} is also edges[{seen[pair]}], "
                             f"expected one link per pair (parallel NVLinks: one link with the summed bandwidth)")
        seen[pair] = i
        links.append(link)
    return links


SERVER_KEYS = ("device", "gpus", "edges")
SERVER_OPTIONAL = ("name", "parts", "memory", "default_fabric", "fabric")  # parts: none beside the GPUs
SERVER_FABRIC_KEYS = ("nic_latency", "switch_latency", "leaf_ports", "nic_efficiency")


def _server(raw: object, where: str, stem: str) -> Server:
    """The one-server format: GPUs ``gpu0..``, named parts, links, and how the NICs join the fabric."""
    raw = _fields(raw, where, SERVER_KEYS, SERVER_OPTIONAL)
    name = _identifier(raw["name"] if "name" in raw else _safe_stem(stem), f"{where}: name")
    device = _choice(raw["device"], f"{where}: device", DEVICES)
    gpus = _integer(raw["gpus"], f"{where}: gpus", 1, MAX_GPUS_PER_NODE)
    parts = _parts(raw.get("parts", {}), where, gpus)
    declared = {f"gpu{i}": "gpu" for i in range(gpus)} | dict(parts)
    links = _links(raw["edges"], where, declared, SERVER_LINK_KINDS, MAX_SERVER_LINKS)
    memory = None
    if "memory" in raw:
        try:
            memory = parse_size(raw["memory"])
        except ValueError as err:
            raise ValueError(f"{where}: memory: {err}") from None
        _integer(memory, f"{where}: memory", 1, MAX_MEMORY_BYTES)
    fabric = _server_fabric(raw.get("fabric"), where, any(role == "nic" for _, role in parts))
    default = _choice(raw.get("default_fabric", "fat-tree"), f"{where}: default_fabric", FABRICS)
    return Server(name, device, gpus, tuple(parts), tuple(links), default_fabric=default, memory_bytes=memory,
                  **fabric)


def _safe_stem(stem: str) -> str:
    """The file name as a machine name when the file gives none (characters outside ``ID`` become ``-``)."""
    cleaned = re.sub(r"[^A-Za-z0-9_.:-]", "-", stem)[:100]
    return cleaned if cleaned[:1].isalpha() else f"m{cleaned}"[:100]


def _parts(raw: object, where: str, gpus: int) -> list[tuple[str, str]]:
    """``parts``: id -> kind, in order (the NICs' order is their rails')."""
    if not isinstance(raw, dict) or len(raw) > MAX_SERVER_PARTS:
        raise ValueError(f"{where}: parts: got {short_repr(raw)}, expected a mapping of at most "
                         f"{MAX_SERVER_PARTS:,} names to one of {', '.join(SERVER_PART_KINDS)}")
    parts = []
    for part, role in raw.items():
        _identifier(part, f"{where}: parts: {short_repr(part)}")
        if re.fullmatch(r"gpu[0-9]+", part):
            raise ValueError(f"{where}: parts: {part!r}: GPU names are implied by gpus ({gpus}), expected another name")
        parts.append((part, _choice(role, f"{where}: parts: {part}", SERVER_PART_KINDS)))
    return parts


def _server_fabric(raw: object, where: str, has_nics: bool) -> dict:
    """Server fields from the ``fabric`` section; ``nic_bandwidth`` is required when there are NICs."""
    if raw is None and not has_nics:
        return {}
    what = f"{where}: fabric"
    raw = _fields(raw, what, ("nic_bandwidth",), SERVER_FABRIC_KEYS)
    fields = {"nic_bandwidth": _bandwidth(raw["nic_bandwidth"], f"{what}: nic_bandwidth")}
    for key in ("nic_latency", "switch_latency"):
        if key in raw:
            fields[f"{key}_ns"] = _latency_ns({"latency": raw[key]}, f"{what}: {key}")
    if "leaf_ports" in raw:
        fields["leaf_ports"] = _integer(raw["leaf_ports"], f"{what}: leaf_ports", 1, 4096)
    if "nic_efficiency" in raw:
        fields["nic_efficiency"] = _efficiency(raw["nic_efficiency"], f"{what}: nic_efficiency")
    return fields


def _old_machine(raw: dict, where: str, stem: str) -> Server:
    """The old two-tier format: an NVSwitch star, one NIC per GPU, a non-blocking fat-tree (the latencies of a
    GPU-GPU path are kept: half of each tier's latency per edge)."""
    raw = _fields(raw, where, ("device", "gpus_per_node", "intra_node", "inter_node"))
    device = _choice(raw["device"], f"{where}: device", DEVICES)
    gpus = _integer(raw["gpus_per_node"], f"{where}: gpus_per_node", 1, MAX_GPUS_PER_NODE)
    (intra_bw, intra_ns), (inter_bw, inter_ns) = (_tier(raw[t], f"{where}: {t}") for t in ("intra_node", "inter_node"))
    links = [Link(f"gpu{i}", "nvswitch0", "nvswitch", intra_bw, intra_ns / 2) for i in range(gpus)]
    links += [Link(f"gpu{i}", f"nic{i}", "pcie", inter_bw, 0.0) for i in range(gpus)]
    parts = (("nvswitch0", "nvswitch"), *((f"nic{i}", "nic") for i in range(gpus)))
    return Server(_safe_stem(stem), device, gpus, parts, tuple(links), inter_bw, "fat-tree",
                  nic_latency_ns=inter_ns / 2)


def _tier(raw: object, what: str) -> tuple[float, float]:
    raw = _fields(raw, what, ("bandwidth", "latency"))
    return _bandwidth(raw["bandwidth"], f"{what}: bandwidth"), _latency_ns(raw, what)


def _full_graph(raw: dict, where: str) -> nx.DiGraph:
    """The full-graph format ``save_topology`` writes: ``graph`` attributes, ``vertices``, ``edges``."""
    raw = _fields(raw, where, ("graph", "vertices", "edges"))
    attrs = _fields(raw["graph"], f"{where}: graph", GRAPH_ATTRS[:4], GRAPH_ATTRS[4:])
    vertices = raw["vertices"]
    if not isinstance(vertices, dict) or len(vertices) > MAX_GRAPH_VERTICES:
        raise ValueError(f"{where}: vertices: got {short_repr(vertices)}, expected a mapping of at most "
                         f"{MAX_GRAPH_VERTICES:,} node ids to their attributes")
    graph = nx.DiGraph(**attrs)
    for vertex, data in vertices.items():
        what = f"{where}: vertices: {short_repr(vertex)}"
        graph.add_node(_identifier(vertex, what), **_fields(data, what, ("kind", "node"), ("rank",)))
    declared = dict.fromkeys(vertices, "")
    cap = MAX_GRAPH_EDGES // 2
    graph.add_edges_from(e for link in _links(raw["edges"], where, declared, EDGE_KINDS, cap) for e in link.directed())
    validate(graph, where)
    return graph


# --- GraphML ---

def _read_graphml(path: str, where: str) -> nx.DiGraph:
    """A GraphML file, refused before parsing if too big, not UTF-8, or declaring a DOCTYPE or ENTITY."""
    text = read_small_text(path, MAX_GRAPHML_BYTES, where, "a GraphML file of at most that", "GraphML")
    lowered = text.lower()
    if "<!doctype" in lowered or "<!entity" in lowered:  # entity expansion ("billion laughs") and external entities
        raise ValueError(f"{where}: has a <!DOCTYPE or <!ENTITY declaration, expected plain GraphML (refused)")
    try:
        graph = nx.parse_graphml(text)
    except (ET.ParseError, nx.NetworkXError, ValueError, TypeError, KeyError, AttributeError, IndexError) as err:
        raise ValueError(f"{where}: not readable GraphML ({short_repr(' '.join(str(err).split()), 200)})") from None
    if graph is None:
        raise ValueError(f"{where}: holds no <graph>, expected one")
    validate(graph, where)
    return _contract_copy(graph)


# --- validation ---

def validate(graph: object, where: str) -> None:
    """Check ``graph`` against the contract (docs/topologies.md); attributes outside the contract are ignored.

    Raises:
        ValueError: one line, ``where`` then the offending graph attribute, node or edge.
    """
    if not isinstance(graph, nx.Graph) or not graph.is_directed():
        raise ValueError(f"{where}: got an undirected graph or none ({type(graph).__name__}), expected a directed "
                         f"graph (GraphML: edgedefault=\"directed\") with one edge per direction")
    if graph.is_multigraph():
        raise ValueError(f"{where}: got parallel edges, expected one edge per direction (parallel NVLinks: one edge "
                         f"with the summed bandwidth)")
    if graph.number_of_nodes() > MAX_GRAPH_VERTICES or graph.number_of_edges() > MAX_GRAPH_EDGES:
        raise ValueError(f"{where}: {graph.number_of_nodes():,} nodes and {graph.number_of_edges():,} edges, expected "
                         f"at most {MAX_GRAPH_VERTICES:,} and {MAX_GRAPH_EDGES:,}")
    nodes, per_node = _check_graph_attrs(graph.graph, where)
    gpus = _check_nodes(graph, where, nodes, per_node)
    _check_edges(graph, where)
    _check_connected(graph, where, gpus)


def _check_graph_attrs(attrs: dict, where: str) -> tuple[int, int]:
    """(nodes, gpus_per_node) after checking every contract graph attribute."""
    for key in GRAPH_ATTRS[:4]:
        if key not in attrs:
            raise ValueError(f"{where}: graph attribute {key} is missing, expected {', '.join(GRAPH_ATTRS[:4])}")
    if not isinstance(attrs["name"], str) or not 1 <= len(attrs["name"]) <= 200:
        raise ValueError(f"{where}: name: got {short_repr(attrs['name'])}, expected a text of 1 to 200 characters")
    _choice(attrs["device"], f"{where}: device", DEVICES)
    per_node = _integer(attrs["gpus_per_node"], f"{where}: gpus_per_node", 1, MAX_GPUS_PER_NODE)
    nodes = _integer(attrs["nodes"], f"{where}: nodes", 1, MAX_NODES)
    if "fabric" in attrs:
        _choice(attrs["fabric"], f"{where}: fabric", FABRICS)
    ratio = attrs.get("oversubscription", 1.0)
    if not (_is_number(ratio) and 1 <= ratio <= MAX_OVERSUBSCRIPTION):
        raise ValueError(f"{where}: oversubscription: got {short_repr(ratio)}, expected 1 to "
                         f"{MAX_OVERSUBSCRIPTION:g}")
    if "memory_bytes" in attrs:
        _integer(attrs["memory_bytes"], f"{where}: memory_bytes", 1, MAX_MEMORY_BYTES)
    return nodes, per_node


def _check_nodes(graph: nx.DiGraph, where: str, nodes: int, per_node: int) -> list[str]:
    """The GPU ids by rank, after checking every node's id, kind, node index and (GPUs) rank."""
    total = nodes * per_node
    by_rank: dict[int, str] = {}
    for vertex, data in graph.nodes(data=True):
        role, home, rank = data.get("kind"), data.get("node"), data.get("rank")
        fine = (type(vertex) is str and ID.fullmatch(vertex) and role in NODE_KINDS and type(home) is int
                and (home == -1 if role in FABRIC_ROLES else 0 <= home < nodes))
        if role == "gpu":
            fine = fine and type(rank) is int and 0 <= rank < total and rank not in by_rank and home == rank // per_node
        else:
            fine = fine and "rank" not in data
        if not fine:
            _check_node(vertex, data, f"{where}: node {short_repr(vertex)}", nodes, per_node, by_rank)
        if role == "gpu":
            by_rank[rank] = vertex
    missing = next((r for r in range(total) if r not in by_rank), None)
    if missing is not None:
        raise ValueError(f"{where}: no GPU has rank {missing}, expected ranks 0 to {total - 1} (nodes x gpus_per_node)")
    return [by_rank[r] for r in range(total)]


def _check_node(vertex: object, data: dict, what: str, nodes: int, per_node: int, by_rank: dict[int, str]) -> None:
    _identifier(vertex, what)
    role = _choice(data.get("kind"), f"{what}: kind", NODE_KINDS)
    low, high = (-1, -1) if role in FABRIC_ROLES else (0, nodes - 1)
    home = _integer(data.get("node"), f"{what}: node", low, high)
    if role != "gpu":
        if "rank" in data:
            raise ValueError(f"{what}: has a rank, expected ranks on GPUs only")
        return
    rank = _integer(data.get("rank"), f"{what}: rank", 0, nodes * per_node - 1)
    if rank in by_rank:
        raise ValueError(f"{what}: rank {rank} is also the rank of GPU {by_rank[rank]!r}, expected each rank once")
    if home != rank // per_node:
        raise ValueError(f"{what}: node: got {home}, expected {rank // per_node} (rank {rank} // gpus_per_node "
                         f"{per_node}: ranks are node-major)")


def _check_edges(graph: nx.DiGraph, where: str) -> None:
    """Each edge's kind, bandwidth, latency and reverse edge: a fast test per edge, the detailed one on a miss."""
    low, high = BANDWIDTH_RANGE
    adjacency, kind = graph.adj, graph.nodes.data("kind")
    for a, b, data in graph.edges(data=True):
        bandwidth, latency, back = data.get("bandwidth"), data.get("latency_ns"), adjacency[b].get(a)
        role, ends = data.get("kind"), tuple(sorted((kind[a], kind[b])))
        efficiency = data.get("efficiency", 1.0)
        if not (a != b and type(bandwidth) in (float, int) and low <= bandwidth <= high
                and type(latency) in (float, int) and 0 <= latency <= MAX_LATENCY_NS
                and type(efficiency) in (float, int) and 0 < efficiency <= 1
                and back is not None and role in EDGE_KINDS and back.get("kind") == role and ends in EDGE_ENDS[role]):
            what = f"{where}: edge {short_repr(a)} -> {short_repr(b)}"
            _check_edge(a, b, data, back, what)
            _check_ends(role, kind[a], kind[b], what)


def _check_edge(a: str, b: str, data: dict, back: dict | None, what: str) -> None:
    if a == b:
        raise ValueError(f"{what}: a self-loop, expected a link between two nodes")
    role = _choice(data.get("kind"), f"{what}: kind", EDGE_KINDS)
    bandwidth, (low, high) = data.get("bandwidth"), BANDWIDTH_RANGE
    if not (_is_number(bandwidth) and low <= bandwidth <= high):
        raise ValueError(f"{what}: bandwidth: got {short_repr(bandwidth)}, expected 1MB/s to 1PB/s (bytes/s)")
    latency = data.get("latency_ns")
    if not (_is_number(latency) and 0 <= latency <= MAX_LATENCY_NS):
        raise ValueError(f"{what}: latency_ns: got {short_repr(latency)}, expected 0 to 1e9 (1 s)")
    _efficiency(data.get("efficiency", 1.0), f"{what}: efficiency")
    if back is None:
        raise ValueError(f"{what}: no reverse edge {short_repr(b)} -> {short_repr(a)}, expected every link in "
                         f"both directions")
    if back.get("kind") != role:
        raise ValueError(f"{what}: kind {role!r} but the reverse edge's is {short_repr(back.get('kind'))}, "
                         f"expected one kind per link")


def _check_ends(role: str, a: str, b: str, what: str) -> None:
    """A link of kind ``role`` joins nodes of kinds ``a`` and ``b`` only where the contract says it may."""
    if tuple(sorted((a, b))) not in EDGE_ENDS[role]:
        allowed = ", ".join(f"{x}-{y}" for x, y in sorted(EDGE_ENDS[role]))
        raise ValueError(f"{what}: kind {role!r} joins a {a} and a {b}, expected a {role} link between {allowed}")


def _check_connected(graph: nx.DiGraph, where: str, gpus: list[str]) -> None:
    """Every node reachable from rank 0 (edges come in pairs, so reachable both ways)."""
    reached = nx.descendants(graph, gpus[0]) | {gpus[0]}
    for rank, gpu in enumerate(gpus):
        if gpu not in reached:
            raise ValueError(f"{where}: GPUs {gpus[0]!r} (rank 0) and {gpu!r} (rank {rank}) are not connected, "
                             f"expected a path between every two GPUs")
    stray = next((v for v in graph if v not in reached), None)
    if stray is not None:
        raise ValueError(f"{where}: node {short_repr(stray)} is not connected to the GPUs, expected every node on a "
                         f"path")


# --- writing ---

def _contract_copy(graph: nx.DiGraph) -> nx.DiGraph:
    """A copy with only the contract's attributes (numbers as the contract's types)."""
    clean = nx.DiGraph(**{k: graph.graph[k] for k in GRAPH_ATTRS if k in graph.graph})
    if "oversubscription" in clean.graph:
        clean.graph["oversubscription"] = float(clean.graph["oversubscription"])
    clean.add_nodes_from((v, {k: d[k] for k in NODE_ATTRS if k in d}) for v, d in graph.nodes(data=True))
    clean.add_edges_from((a, b, {"bandwidth": float(d["bandwidth"]), "latency_ns": float(d["latency_ns"]),
                                 "kind": d["kind"], **({"efficiency": float(d["efficiency"])} if "efficiency" in d
                                                       else {})}) for a, b, d in graph.edges(data=True))
    return clean


def _to_yaml(graph: nx.DiGraph) -> str:
    """The full-graph YAML: each physical link once, with ``reverse`` where the directions differ."""
    edges, done = [], set()
    for a, b, data in graph.edges(data=True):
        if (b, a) in done:
            continue
        done.add((a, b))
        entry = {"a": a, "b": b, "kind": data["kind"], "bandwidth": data["bandwidth"], "latency_ns": data["latency_ns"]}
        if "efficiency" in data:
            entry["efficiency"] = data["efficiency"]
        back = graph.adj[b][a]
        if back.get("efficiency", 1.0) != data.get("efficiency", 1.0):  # the format holds one a link: refuse, not drop
            raise ValueError(f"the link {short_repr(a)}-{short_repr(b)} has efficiency {data.get('efficiency', 1.0)} "
                             f"one way and {back.get('efficiency', 1.0)} the other, expected one (the YAML format "
                             f"holds one a link; save as .graphml to keep both)")
        if (back["bandwidth"], back["latency_ns"]) != (data["bandwidth"], data["latency_ns"]):
            entry["reverse"] = {"bandwidth": back["bandwidth"], "latency_ns": back["latency_ns"]}
        edges.append(entry)
    body = {"graph": dict(graph.graph), "vertices": {v: dict(d) for v, d in graph.nodes(data=True)}, "edges": edges}
    header = "# pipescope topology: a full graph, as save_topology writes it (docs/topologies.md)\n"
    return header + yaml.safe_dump(body, sort_keys=False, default_flow_style=None, width=200)


def server_yaml(server: Server, header: str = "") -> str:
    """``server`` in the one-server YAML format, with units people read (``450GB/s``, ``750ns``), exact."""
    top = {"name": server.name, "device": server.device, "gpus": server.gpus}
    if server.memory_bytes is not None:
        gib = server.memory_bytes / 2**30
        top["memory"] = f"{gib:g}GiB" if parse_size(f"{gib:g}GiB") == server.memory_bytes else server.memory_bytes
    top["default_fabric"] = server.default_fabric
    edges = []
    for link in server.links:
        entry = {"a": link.a, "b": link.b, "kind": link.kind, "bandwidth": _bandwidth_text(link.bandwidth),
                 "latency": _time_text(link.latency_ns)}
        if link.reverse_bandwidth is not None or link.reverse_latency_ns is not None:
            back = link.directed()[1][2]
            entry["reverse"] = {"bandwidth": _bandwidth_text(back["bandwidth"]),
                                "latency": _time_text(back["latency_ns"])}
        if link.efficiency != 1.0:
            entry["efficiency"] = link.efficiency
        edges.append(entry)
    fabric = {"nic_bandwidth": _bandwidth_text(server.nic_bandwidth, ("Gbit/s", "GB/s")),
              "nic_latency": _time_text(server.nic_latency_ns), "switch_latency": _time_text(server.switch_latency_ns),
              "leaf_ports": server.leaf_ports}
    if server.nic_efficiency != 1.0:
        fabric["nic_efficiency"] = server.nic_efficiency

    def dump(data: dict, flow: bool | None) -> str:
        return yaml.safe_dump(data, sort_keys=False, default_flow_style=flow, width=200)

    sections = dump(top, False) + dump({"parts": dict(server.parts)}, False)
    return header + sections + dump({"edges": edges}, None) + dump({"fabric": fabric}, False)


def _bandwidth_text(value: float, units: tuple[str, ...] = ("GB/s", "Gbit/s")) -> str | float:
    """The first of ``units`` that writes ``value`` exactly, else the number."""
    for unit in units:
        text = f"{value / parse_bandwidth('1' + unit):g}{unit}"
        if parse_bandwidth(text) == value:
            return text
    return value


def _time_text(ns: float) -> str:
    for unit, scale in ((("us", 1e3), ("ns", 1.0)) if ns >= 1000 else (("ns", 1.0), ("us", 1e3))):
        text = f"{ns / scale:g}{unit}"
        if round(parse_time(text) * 1e9, 6) == ns:
            return text
    return f"{ns!r}ns"


MACHINES_DIR = os.path.join(os.path.dirname(__file__), "machines")
FILE_ALIASES = {"p3dn-v100": "p3dn.24xlarge"}  # files kept under an old name for configs that name the file


def write_machine_files(folder: str = MACHINES_DIR) -> list[str]:
    """Write every built-in server to ``folder/<name>.yaml`` in the one-server format (the shipped files are made
    this way; tests/test_topologies.py checks they load equal to the built-ins). Returns the paths."""
    paths = []
    for file, name in [(n, n) for n in BUILTINS] + list(FILE_ALIASES.items()):
        header = (f"# {file}: the built-in {name!r} in the one-server format (docs/topologies.md, which sources every "
                  f"number).\n# Written by topology_io.write_machine_files(); copy it to describe another server.\n")
        path = os.path.join(folder, f"{file}.yaml")
        write_atomic(path, server_yaml(BUILTINS[name], header))
        paths.append(path)
    return paths
