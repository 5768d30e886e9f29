"""Dot parsing for :mod:`l2prefetch.tuning.trace`: each loader node's neighbours in a
``cuGraphDebugDotPrint`` graph.  Pure Python; any text, in time linear in its length.
"""

from __future__ import annotations

import re

from .trace_events import LOADER_PREFIX

__all__ = ["dot_neighbours"]

# Every pattern here is linear in the text: a node starts at a line's start, an edge at a
# name's start, and nothing spans a line but a node's label, which is searched for once.
_DOT_NODE = re.compile(r'^[ \t]*"?([\w.]+)"?[ \t]*\[', re.M)
_DOT_NODE_END = re.compile(r'\];?[ \t\r\f\v]*$', re.M)
_DOT_EDGE = re.compile(r'(?<![\w."])"?([\w.]+)"?[ \t]*->[ \t]*"?([\w.]+)"?')
# A kernel node's record label: {KERNEL | {ID | 53 (topoId: 4) | NAME\<\<\<grid...
_DOT_KERNEL = re.compile(r"\{ID\s*\|[^|]*\|\s*([^|{}<>\\\s]+)")
_DIGITS = re.compile(r"\d+")


def _demangle(name: str) -> str:
    """The qualified name of an Itanium-mangled function (``_ZN2at6native6kernelI...`` ->
    ``at::native::kernel``), enough to tell kernels apart; other names as they are.
    Linear in the name: a length is read only where it can fit in what follows."""
    if not re.match(r"_ZN?\d", name):
        return name
    parts, pos = [], 2 + (name[2:3] == "N")
    room = len(str(len(name)))   # a length of more digits than this cannot fit
    while (num := _DIGITS.match(name, pos)) and len(num.group()) <= room:
        size, pos = int(num.group()), num.end()
        if size == 0 or size > len(name) - pos:
            break
        parts.append(name[pos:pos + size])
        pos += size
    return "::".join(parts) or name


def _dot_nodes(text: str) -> dict[str, str]:
    """``name -> label`` of a dot text's node statements (``NAME [ ... ];``), the first
    statement of each name; a statement that is never closed ends the search."""
    nodes: dict[str, str] = {}
    pos = 0
    while (m := _DOT_NODE.search(text, pos)) is not None:
        end = _DOT_NODE_END.search(text, m.end())
        if end is None:        # unclosed: no later statement can close either
            break
        if "->" not in text[m.start():m.end()]:
            nodes.setdefault(m.group(1), text[m.end():end.start()])
        pos = end.end()
    return nodes


def _node_order(node: str) -> tuple:
    """Nodes by the numbers in their names (``graph_1_node_10`` after ``..._node_9``),
    compared as digit strings: a 5000-digit number is never converted to an int."""
    return tuple((len(d.lstrip("0")), d.lstrip("0")) for d in _DIGITS.findall(node)), node


def dot_neighbours(text: str) -> list[str]:
    """Per loader node of a ``cuGraphDebugDotPrint`` graph, in node order, a line naming
    the nodes it depends on and those that depend on it.

    Text that is not such a graph gives the lines of what it holds (none for most), never
    an error, in time linear in its length (and in the lines written)."""
    nodes = _dot_nodes(text)
    preds: dict[str, list[str]] = {}
    succs: dict[str, list[str]] = {}
    for a, b in _DOT_EDGE.findall(text):
        if a in nodes and b in nodes:
            succs.setdefault(a, []).append(b)
            preds.setdefault(b, []).append(a)
    shorts: dict[str, str] = {}

    def short(node: str) -> str:
        if node not in shorts:
            label = nodes[node]
            at = label.find("{ID")    # the record's first ID field only (one search)
            found = _DOT_KERNEL.match(label, at) if at >= 0 else None
            name = node if len(node) <= 80 else node[:77] + "..."
            shorts[node] = f"{name} ({_demangle(found.group(1))[:60]})" if found else name
        return shorts[node]

    out = []
    for node in sorted((n for n, label in nodes.items() if LOADER_PREFIX in label),
                       key=_node_order):
        before = [short(a) for a in preds.get(node, [])]
        after = [short(b) for b in succs.get(node, [])]
        out.append(f"node {short(node)} depends on {', '.join(before) or 'nothing'}; "
                   f"{', '.join(after) or 'nothing (a sink of the graph)'} depend"
                   f"{'s' if len(after) <= 1 else ''} on it.")
    return out
