"""Every equal-cost shortest path between two nodes of the interconnect (docs/network.md, "Finding the paths").

``EqualCostRouter`` is a bidirectional Dijkstra that keeps its labels and stops as soon as the two searches meet,
then walks the tight edges between them. It is written by hand because networkx has no search that lists every
shortest path without a full Dijkstra from the source (``all_shortest_paths``), and its bidirectional Dijkstra
returns one path, settling nodes until one is settled from both sides. On a fat-tree that means relaxing every
spine's edges to every leaf; stopping at the meeting does not (docs/architecture.md, "Why some parts are written by
hand").
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence

Arc = tuple[int, int, int]  # (the node at the other end, weight, edge id)
INF = float("inf")


class EqualCostRouter:
    """Shortest paths over directed edges ``names[e] = (a, b)`` of positive integer ``weights[e]``.

    Paths come as tuples of edge ids, in lexicographic order of those tuples. That is the order of a depth-first walk
    that tries a node's out-edges in ``names`` order, so a list cut at ``limit`` keeps the same paths as any such
    walk would.
    """

    def __init__(self, nodes: Iterable[str], names: Sequence[tuple[str, str]], weights: Sequence[int]):
        self.index = {node: i for i, node in enumerate(nodes)}
        self.out: list[list[Arc]] = [[] for _ in self.index]
        self.into: list[list[Arc]] = [[] for _ in self.index]
        for e, ((a, b), weight) in enumerate(zip(names, weights)):
            ia, ib = self.index[a], self.index[b]
            self.out[ia].append((ib, weight, e))
            self.into[ib].append((ia, weight, e))

    def paths(self, source: str, target: str, limit: int) -> list[tuple[int, ...]]:
        """Up to ``limit`` shortest paths from ``source`` to ``target`` (empty when there is none)."""
        s, t = self.index[source], self.index[target]
        if s == t:
            return [()]
        search = _Meeting(self, s, t)
        if search.length is None:
            return []
        return search.walk(limit)


class _Meeting:
    """One bidirectional search from ``s`` (forward, over out-edges) and ``t`` (backward, over in-edges).

    Each side keeps a label per node it reached (a path length, never below the true distance) and, per label, the
    settled neighbours that gave it (``tight``). The search stops once the two heaps' tops sum to at least the best
    path through a node labelled from both sides (``length``). Then every node with a true distance from s up to
    the forward top has an exact forward label, likewise backwards, and every shortest path holds a node whose two
    labels sum to ``length`` (both exact): the last node within the forward top, or the next one.
    """

    def __init__(self, router: EqualCostRouter, s: int, t: int):
        self.router, self.s, self.t = router, s, t
        self.label: tuple[dict[int, int], dict[int, int]] = ({s: 0}, {t: 0})
        self.tight: tuple[dict[int, list[Arc]], dict[int, list[Arc]]] = ({s: []}, {t: []})
        self.top = self._search()
        self.length = None if self.top is None else self._best

    def _search(self) -> tuple[float, float] | None:
        # Each side's state in one tuple, unpacked once per settled node: this loop is most of a large
        # collective's routing time, and looking the state up per step cost 15-35% of it (two sittings).
        sides = tuple((heap, set(), arcs, mine, other, tight) for heap, arcs, mine, other, tight in (
            ([(0, self.s)], self.router.out, self.label[0], self.label[1], self.tight[0]),
            ([(0, self.t)], self.router.into, self.label[1], self.label[0], self.tight[1])))
        forward_heap, backward_heap = sides[0][0], sides[1][0]
        best = INF
        while True:
            top_f = forward_heap[0][0] if forward_heap else INF
            top_b = backward_heap[0][0] if backward_heap else INF
            if top_f + top_b >= best:
                self._best = best
                return None if best == INF else (top_f, top_b)
            heap, settled, arcs, mine, other, tight = sides[0] if top_f <= top_b else sides[1]
            dist, node = heapq.heappop(heap)
            if node in settled or dist > mine[node]:
                continue
            settled.add(node)
            for nxt, weight, e in arcs[node]:
                far, known = dist + weight, mine.get(nxt)
                if known is None or far < known:
                    mine[nxt], tight[nxt] = far, [(node, weight, e)]
                    heapq.heappush(heap, (far, nxt))
                    meet = other.get(nxt)
                    if meet is not None and far + meet < best:
                        best = far + meet
                elif far == known:
                    tight[nxt].append((node, weight, e))

    def _on_forward_side(self) -> set[int]:
        """Nodes on a shortest path with an exact forward label: the meeting nodes, then their tight forward
        predecessors, transitively. It holds every node of a shortest path nearer s than the forward top."""
        forward, backward = self.label
        useful = {node for node, d in forward.items() if node in backward and d + backward[node] == self.length}
        stack = list(useful)
        while stack:
            for before, _, _ in self.tight[0].get(stack.pop(), ()):
                if before not in useful:
                    useful.add(before)
                    stack.append(before)
        return useful

    def walk(self, limit: int) -> list[tuple[int, ...]]:
        """Depth first from s along tight edges, lowest edge id first, until ``limit`` paths reach t."""
        useful = self._on_forward_side()
        (forward, backward), length, top_back = self.label, self.length, self.top[1]
        paths: list[tuple[int, ...]] = []
        stack: list[tuple[int, int, tuple[int, ...]]] = [(self.s, 0, ())]
        while stack and len(paths) < limit:
            node, done, edges = stack.pop()
            if node == self.t:
                paths.append(edges)
                continue
            left = backward.get(node)
            if left is not None and done + left == length and left <= top_back:
                # every next node of a shortest path from here is settled backwards and recorded as tight
                arcs = sorted(self.tight[1][node], key=lambda arc: arc[2])
            else:
                arcs = self.router.out[node]
            for nxt, weight, e in reversed(arcs):
                far = done + weight
                after = backward.get(nxt)
                if (after is not None and far + after == length) or (nxt in useful and forward[nxt] == far):
                    stack.append((nxt, far, edges + (e,)))
        return paths
