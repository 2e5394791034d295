"""Routes between identical servers, searched once per kind of pair (docs/network.md, "Finding the paths").

``topologies.graphs.build_cluster`` names server k's vertices ``n{k}.*``, makes every server the same subgraph, added
in the same order, and numbers a fabric switch's edges down to the servers server by server, before its edges to
other switches. Where every server also meets the fabric the same way (a rail fabric: NIC i of each server to leaf
i; a fat-tree of one leaf) and no link has failed, renumbering the servers is an automorphism of the graph that keeps
each edge's latency, so the shortest paths from server A's GPU i to server B's GPU j are those from server 0's GPU i
to server 1's GPU j (server 0's own when A = B), renamed. The renaming maps the lower of the two servers to the lower
of A and B, so it also keeps the router's order of the paths (lexicographic in edge ids) and which ``limit`` of them
it keeps: the same list as a search, to the edge. ``ServerSymmetry.of`` checks all of this on the graph itself
(a file's graph too), and a class whose paths cross a third server (none in the built-in machines), or whose list
reaches a search's limit, is searched pair by pair, as without it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import networkx as nx

Routes = list[tuple[tuple[int, ...], int]]  # (edge ids, summed latency ns) per path, as FlowFabric.routes
Renaming = dict[int, list[int]]  # a class's server (0 or 1) -> the pair's server's edges, by place


class ServerSymmetry:
    """Maps a pair of GPUs to its class's pair on servers 0 and 1 and the class's paths back to the pair's edges."""

    def __init__(self, server: dict[str, int], local: dict[str, str], edge_server: list[int], place: list[int],
                 server_edges: list[list[int]], limit: int):
        self.limit = limit  # the most paths a search lists
        self.server, self.local = server, local  # per vertex: its server (-1: the fabric's), its name within it
        self.edge_server, self.place = edge_server, place  # per edge: its server (-1: the fabric's), its place there
        self.server_edges = server_edges  # per server: its edges in id order (the same places in every server)
        self._canonical: dict[tuple[str, str], Routes | None] = {}

    @classmethod
    def of(cls, graph: nx.DiGraph, names: Sequence[tuple[str, str]], latencies: Sequence[float],
           limit: int) -> ServerSymmetry | None:
        """The symmetry of ``graph`` (edges ``names`` in id order, their ``latencies``; searches list at most
        ``limit`` paths), or None where it has none: one server, servers that differ (a failed link, a fat-tree leaf
        that holds some servers and not others), a link between two servers, or a switch whose edges are not
        numbered server by server."""
        server = {v: int(data.get("node", -1)) for v, data in graph.nodes(data=True)}
        servers = max(server.values(), default=-1) + 1
        if servers < 2 or any(k >= 0 and not v.startswith(f"n{k}.") for v, k in server.items()):
            return None
        local = {v: v[len(f"n{k}."):] if k >= 0 else v for v, k in server.items()}
        keys: list[list[tuple[bool, str, bool, str, float]]] = [[] for _ in range(servers)]
        edges: list[list[int]] = [[] for _ in range(servers)]
        edge_server, place = [-1] * len(names), [-1] * len(names)
        last_down: dict[str, float] = {}  # per switch: the server its latest out-edge went to (inf: a switch)
        for e, (a, b) in enumerate(names):
            sa, sb = server[a], server[b]
            if sa >= 0 and sb >= 0 and sa != sb:
                return None  # a link between two servers: renumbering them would not keep the graph
            if sa < 0:
                down = sb if sb >= 0 else float("inf")
                if down < last_down.get(a, -1):
                    return None  # a switch's edges out of server order: renaming would reorder the paths
                last_down[a] = down
            k = edge_server[e] = max(sa, sb)
            if k >= 0:
                place[e] = len(edges[k])
                # which end is a switch, so that a server's own part named as a switch is not taken for it
                keys[k].append((sa < 0, local[a], sb < 0, local[b], latencies[e]))
                edges[k].append(e)
        if any(other != keys[0] for other in keys[1:]):
            return None
        return cls(server, local, edge_server, place, edges, limit)

    def of_class(self, source: str, target: str,
                 search: Callable[[str, str], Routes]) -> tuple[Routes, Renaming] | None:
        """The routes of the class of (``source``, ``target``), GPUs of servers (``search``ed once per class), and
        the renaming that takes them to this pair (``rename``); None where an end is not a server's, or the class's
        paths cross a third server or may have (a list cut at ``limit``): the caller searches the pair itself, as a
        third server's edges can sort before the two servers' in one pair and after them in another."""
        a, b = self.server[source], self.server[target]
        if a < 0 or b < 0:
            return None
        # the class's servers of the source and the target, in the order of a and b
        first, second = (0, 1) if a < b else (1, 0) if a > b else (0, 0)
        key = (f"n{first}.{self.local[source]}", f"n{second}.{self.local[target]}")
        if key not in self._canonical:
            found = search(*key)
            inside = all(self.edge_server[e] in (-1, first, second) for path, _ in found for e in path)
            self._canonical[key] = found if inside and len(found) < self.limit else None
        canonical = self._canonical[key]
        return None if canonical is None else (canonical, {first: self.server_edges[a], second: self.server_edges[b]})

    def rename(self, path: tuple[int, ...], onto: Renaming) -> tuple[int, ...]:
        """A class path's edges as the pair's: a server's edge to the same place in the pair's server."""
        server, place = self.edge_server, self.place
        return tuple(e if server[e] < 0 else onto[server[e]][place[e]] for e in path)
