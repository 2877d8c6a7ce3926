"""The shape of a draft tree, in one place: parents, depths, ancestors, paths.

A tree is ``parents: list[int]`` over nodes ``0..N-1`` in topological order: ``parents[i]`` is node i's
parent, below i, or -1 for a child of the root (the root is not a node: the last committed token for a
draft, the cached prefix for a forward). A chain of k nodes is the tree ``[-1, 0, ..., k-2]``.

Used by the drafters (``Draft``), the verifiers' tree rules (``verifiers/tree.py``) and both KV models'
tree forwards (``models/kv.py``, ``models/fast.py``). Pure: no model, only lists and small tensors.
"""

from __future__ import annotations

import torch


def check_parents(parents, n: int | None = None) -> list[int]:
    """``parents`` as a list of ints, or ValueError unless each entry is in [-1, i) (topological order)
    and, when ``n`` is given, there are ``n`` of them."""
    try:
        parents = [int(x) for x in parents]
    except (TypeError, ValueError):
        raise ValueError("parents must be a sequence of integers (-1 for children of the root)") from None
    if n is not None and len(parents) != n:
        raise ValueError(f"parents has {len(parents)} entries but there are {n} tree tokens")
    for i, parent in enumerate(parents):
        if not -1 <= parent < i:
            raise ValueError(
                f"parents[{i}] = {parent}: nodes must be in topological order, each parent in [-1, {i - 1}] "
                "(-1 = child of the root)"
            )
    return parents


def chain_as_tree(k: int) -> list[int]:
    """The parents of a chain of ``k`` nodes: ``[-1, 0, 1, ..., k-2]``."""
    if k < 0:
        raise ValueError(f"chain_as_tree: k must be >= 0, got {k}")
    return list(range(-1, k - 1))


def depths(parents) -> list[int]:
    """Depth of each node, 1 for a child of the root (= the path length when it is the last accepted)."""
    parents = check_parents(parents)
    out: list[int] = []
    for parent in parents:
        out.append(1 if parent < 0 else out[parent] + 1)
    return out


def depths_and_ancestors(parents) -> tuple[torch.Tensor, torch.Tensor]:
    """A tree forward's geometry: each node's depth (LongTensor [n], 1 for a child of the root, as
    :func:`depths`) and the [n, n] ancestor-or-self matrix (row i: the nodes node i may attend to)."""
    parents = check_parents(parents)
    n = len(parents)
    allowed = torch.eye(n, dtype=torch.bool)
    for i, parent in enumerate(parents):
        if parent >= 0:
            allowed[i] |= allowed[parent]
    return torch.tensor(depths(parents), dtype=torch.long), allowed


def children_of(parents) -> list[list[int]]:
    """``out[0]``: the root's children; ``out[i + 1]``: node i's children; each in node order."""
    parents = check_parents(parents)
    out: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for i, parent in enumerate(parents):
        out[parent + 1].append(i)
    return out


def path_to(parents, node: int) -> list[int]:
    """The nodes from the root down to ``node`` (``[]`` for -1, the root itself)."""
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def paths(parents) -> list[list[int]]:
    """Every root-to-leaf path (node indices, root side first), leaves in node order."""
    parents = check_parents(parents)
    has_child = [False] * len(parents)
    for parent in parents:
        if parent >= 0:
            has_child[parent] = True
    return [path_to(parents, leaf) for leaf, inner in enumerate(has_child) if not inner]


__all__ = ["chain_as_tree", "check_parents", "children_of", "depths", "depths_and_ancestors", "path_to", "paths"]
