r"""Verification over a draft TREE: pure functions of tensors (a verifier never sees a model).

Tree layout (flattened, exactly as the target forward sees it, ``models/kv.py``
``forward(tokens, tree_parents=parents)``):

- nodes ``0..N-1`` in topological order (a parent's index is below its children's);
- ``parents: list[int]``, -1 for the children of the root (the root is the last committed token, not
  a node);
- ``tokens``: LongTensor [N], node i's token;
- ``target_probs``: FloatTensor [N+1, V]; row 0 is p_target after the root, row i+1 is p_target
  after node i (the distribution node i's children are judged against / its bonus row);
- ``draft_probs``: FloatTensor [N, V] or None; row i is the p_draft row node i's token was drawn
  from, so siblings carry the same row (their parent's draft distribution).

Every rule returns a :class:`~speculate.verifiers.base.Verdict`, the type chain verifiers return too:
``path``, the accepted node indices from the root down (hand them to ``keep_path(start, path)``), the
``next_token`` the target adds after them, and the ``state`` for the next round. On a chain-shaped tree
(:func:`chain_as_tree`) each rule gives exactly the verdict of its chain verifier, consuming the shared
generator the same way, so seeded runs coincide.

Each verifier's ``verify_tree`` method calls its rule here (a subclass inherits it); the rules with
parameters take the verifier itself, whose constructor checked them (``Verifier.params``):

- :func:`tree_greedy`      exact match with the target argmax (lossless for greedy decoding)
- :func:`tree_sample`      multi-candidate speculative sampling (lossless for sampling)
- :func:`tree_consultant`  Consultant Decoding along every root-to-leaf path (lossy)
- :func:`tree_typical`     Medusa typical acceptance along every root-to-leaf path (lossy)
- :func:`tree_per_token`   any rule that judges each token alone at its row, along every path

Tree shape (depths, children, paths) is ``speculate.tree_shape``'s; re-exported here.

The deterministic rules (greedy, consultant, typical) accept the set of nodes whose whole path from
the root passes the chain rule, and keep the deepest such node. Ties between equally deep nodes go to
the highest summed target log-likelihood of the path, sum log p_target(x) (Medusa's choice,
``evaluate_posterior``: ``best_candidates[argmax(likelihood)]``), then to the first in node order.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..sampling import argmax
from ..tree_shape import chain_as_tree, check_parents, children_of, depths, path_to, paths
from .base import Verdict, sample_from, target_token, uniform
from .rows import argmax_rows, ema, nll, residual_distribution



def _is_integer(dtype: torch.dtype) -> bool:
    return not (dtype.is_floating_point or dtype.is_complex)


def _validate(tokens, parents, target_probs, draft_probs=None, need_draft=False, who="tree"):
    """Shape checks; returns (token list, parent list, V)."""
    is_tensor = isinstance(tokens, torch.Tensor)
    if not is_tensor or tokens.dim() != 1 or tokens.dtype in (torch.bool,) or not _is_integer(tokens.dtype):
        got = f"{tokens.dtype} {tuple(tokens.shape)}" if is_tensor else type(tokens).__name__
        raise ValueError(f"{who}: tokens must be a 1-D integer tensor [N], got {got}")
    n = tokens.shape[0]
    parents = check_parents(parents, n)
    if not isinstance(target_probs, torch.Tensor) or target_probs.dim() != 2 or target_probs.shape[0] != n + 1:
        shape = tuple(target_probs.shape) if isinstance(target_probs, torch.Tensor) else type(target_probs).__name__
        raise ValueError(f"{who}: target_probs must be [N+1, V] = [{n + 1}, V] (row 0 after the root, row i+1 "
                         f"after node i), got {shape}")
    v = target_probs.shape[1]
    if need_draft and draft_probs is None:
        raise ValueError(f"{who} needs draft_probs (p_draft rows, [N, V])")
    if draft_probs is not None and (not isinstance(draft_probs, torch.Tensor) or tuple(draft_probs.shape) != (n, v)):
        shape = tuple(draft_probs.shape) if isinstance(draft_probs, torch.Tensor) else type(draft_probs).__name__
        raise ValueError(f"{who}: draft_probs must be [N, V] = [{n}, {v}] (row i: the distribution node i was "
                         f"drawn from), got {shape}")
    token_list = [int(t) for t in tokens.tolist()]
    bad = [t for t in token_list if not 0 <= t < v]
    if bad:
        raise ValueError(f"{who}: token ids must be in [0, {v}), got {bad[:5]}")
    return token_list, parents, v


def _target_at_nodes(target_probs: torch.Tensor, tokens: list[int], parents: list[int]) -> list[float]:
    """p_target(x_i | path to node i) for every node: ``target_probs[parents[i] + 1, tokens[i]]``."""
    if not tokens:
        return []
    rows = torch.tensor([parent + 1 for parent in parents], device=target_probs.device)
    cols = torch.tensor(tokens, device=target_probs.device)
    return target_probs[rows, cols].tolist()


def _deepest(passing: list[bool], parents: list[int], score: list[float]) -> int:
    """The deepest passing node (-1: none); ties go to the lowest summed ``score`` along the path
    (score = NLL, i.e. the highest target log-likelihood), then to the first in node order.
    ``passing`` must already be closed under ancestors (a passing node's parent passes)."""
    best, best_key = -1, (0, 0.0)
    depth = [0] * len(parents)
    total = [0.0] * len(parents)
    for i, parent in enumerate(parents):
        if not passing[i]:
            continue
        depth[i] = 1 + (depth[parent] if parent >= 0 else 0)
        total[i] = score[i] + (total[parent] if parent >= 0 else 0.0)
        key = (depth[i], -total[i])
        if key > best_key:  # strict: the first in node order wins an exact tie
            best, best_key = i, key
    return best


# ------------------------------------------------------------------------------------------ greedy


def tree_greedy(tokens: torch.Tensor, parents, target_probs: torch.Tensor, state: Any = None) -> Verdict:
    """Greedy verification over a tree: the longest path whose every token is the target argmax given
    its prefix; ``next_token`` = argmax of the row after it. The output is token for token the
    target's greedy decoding. Walking from the root, at each node follow the child whose token is the
    argmax of the current row, stop when none matches. With duplicate sibling tokens (possible when
    siblings are drafted with replacement) every matching branch is followed and the deepest match is
    kept (they spell the same greedy tokens; the first in node order on equal depth). ``state`` is
    passed through."""
    token_list, parents, _ = _validate(tokens, parents, target_probs, who="tree_greedy")
    target_argmax = argmax(target_probs).tolist()  # [N+1]
    passing = [False] * len(parents)
    for i, parent in enumerate(parents):
        passing[i] = (parent < 0 or passing[parent]) and token_list[i] == target_argmax[parent + 1]
    node = _deepest(passing, parents, [0.0] * len(parents))
    return Verdict(path=path_to(parents, node), next_token=int(target_argmax[node + 1]), state=state)


# --------------------------------------------------------------------------------------- sampling


def tree_sample(
    tokens: torch.Tensor,
    parents,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    generator: torch.Generator | None,
    sample_probs: torch.Tensor | None = None,
    *,
    replacement: bool = False,
    state: Any = None,
    correction: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> Verdict:
    r"""Lossless multi-candidate speculative sampling over a tree (SpecInfer's multi-step speculative
    sampling, Miao et al. 2024, ASPLOS, section 4, with its theorem that MSS preserves the LLM's
    distribution; the tree rule of EAGLE; without replacement: the recursive rejection sampling of
    Jeon et al. 2024, "Recursive Speculative Decoding", arXiv 2402.14160).

    Rule, from the root: at the current node v (current target row T := p_target row v+1, draft row
    D := the shared p_draft row of v's children), try v's children c_1, c_2, ... in node order:

    - accept c_j (token x) with probability min(1, T(x) / D(x)), tested as ``u_c * D(x) < T(x)``
      (u_c ~ U[0,1), as in the chain ``SampleVerifier``); on acceptance move to c_j and start afresh
      with its target row and its children's draft row;
    - on rejection T := norm(max(0, T - D)) (the residual, ``residual_distribution``), and, only when
      ``replacement=False``, D := D with x zeroed, renormalised;
    - all children rejected: ``next_token`` ~ the current residual T. A node without children (all of
      its path accepted): the bonus ``next_token`` ~ its target row.

    Which rule matches which drafter (the one thing the drafter must get right):

    - ``replacement=True``: the siblings are independent draws, each from its own draft row: i.i.d.
      from their parent's row (multinomial with replacement; duplicates allowed; D stays fixed — SpecInfer's
      MSS as published), or from different drafters (SpecInfer's merged trees of several draft models:
      D_j := sibling j's own row, e.g. a one-hot row for a prompt-lookup guess, drafters/with_lookup.py).
    - ``replacement=False`` (default): the siblings are drawn WITHOUT replacement, c_{j+1} from D with
      x_1..x_j zeroed and renormalised (``torch.multinomial(..., replacement=False)``; no duplicates).
      The verifier then zeroes each rejected x in D, so D_j is exactly the row c_j was drawn from.

    The two are not interchangeable: verifying a drafter of one kind with the other rule is biased
    (the tests demonstrate it). For a node with a single child both rules coincide.

    Proof of losslessness (for each scheme with its rule). Fix a node v; write T_1 = p_target row v+1,
    D_1 its children's draft row, T_{j+1} = norm(max(0, T_j - D_j)), D_{j+1} = D_j (with replacement)
    or D_j with x_j zeroed and renormalised (without). The drafting scheme guarantees that, given
    x_1..x_{j-1}, x_j ~ D_j. Let O_j be the distribution of the token emitted at this position given
    that child j is tried (O_{m+1} = T_{m+1}, the final residual draw). Single-step speculative
    sampling (Leviathan et al. 2023, Chen et al. 2023): P(x_j = y, accepted) = min(D_j(y), T_j(y)) and
    P(rejected) = sum_y max(0, T_j(y) - D_j(y)), the mass of the residual. If O_{j+1} = T_{j+1}
    whatever x_1..x_j were, then
    O_j(y) = min(D_j(y), T_j(y)) + max(0, T_j(y) - D_j(y)) = T_j(y). By backward induction O_1 = T_1:
    the token emitted after v is p_target(. | path to v) distributed (SpecInfer's MSS theorem). The
    subtree under an accepted child was drafted from the path to that child alone, independently of
    the acceptance coins and of the other siblings, so it is a valid draft tree for the next position,
    and by induction on depth every emitted token (accepted path, then ``next_token``) follows
    p_target given everything emitted before: the output sequence is distributed exactly as sampling
    from the target. Assumptions: the rows are the exact distributions the tokens were drawn from
    (after any temperature / top-p), and a drawn node is never dropped or reordered because of its
    token (whether a further child is drawn may depend on what was drawn before it; post-hoc pruning
    or reranking of drawn nodes, e.g. by cumulative draft score, or deterministic top-k children,
    breaks the proof — and so would merging a lookup guess into an equal drawn sibling). With
    ``replacement=True`` the siblings' rows may differ: x_j ~ D_j independently of x_1..x_{j-1} is all the
    induction uses.

    Randomness: one ``uniform(N)`` draw up front (u_c for node c; each node is tested at most once),
    then one :func:`~speculate.verifiers.base.sample_from` draw, all from ``generator``; on a chain
    this is exactly ``SampleVerifier``'s consumption, so the verdicts coincide for the same seed.
    ``target_probs`` must already be the distribution to sample from (warped); ``sample_probs`` is
    accepted for interface symmetry and ignored, as in ``SampleVerifier``. ``state`` is passed
    through. Without replacement, siblings must carry identical draft rows (ValueError otherwise).
    ``correction``: the residual rule, :func:`residual_distribution` by default (``SampleVerifier`` passes
    its ``correction_distribution``, so that a subclass that changes it changes both forms).
    """
    correction = residual_distribution if correction is None else correction
    token_list, parents, _ = _validate(tokens, parents, target_probs, draft_probs, need_draft=True, who="tree_sample")
    children = children_of(parents)
    if not replacement:  # (with replacement each sibling has its own row)
        for kids in children:
            for c in kids[1:]:
                if not torch.equal(draft_probs[c], draft_probs[kids[0]]):
                    raise ValueError(f"tree_sample: siblings {kids[0]} and {c} have different draft_probs rows; "
                                     "siblings drawn without replacement come from their parent's single draft "
                                     "distribution")
    u = uniform(len(token_list), generator, dtype=torch.float64).tolist() if token_list else []
    path: list[int] = []
    row = 0  # target row of the current node (node + 1)
    while True:
        kids = children[row]
        if not kids:  # leaf (or empty tree): the bonus token from the node's own row
            return Verdict(path=path, next_token=sample_from(target_probs[row], generator), state=state)
        target_row: torch.Tensor | None = None  # None: still the untouched target_probs[row]
        draft_row = draft_probs[kids[0]]
        accepted = -1
        for c in kids:
            x = token_list[c]
            if replacement:  # independent draws: each sibling against the row it was drawn from
                draft_row = draft_probs[c]
            t_x = float(target_probs[row, x]) if target_row is None else float(target_row[x])
            d_x = float(draft_row[x])
            if u[c] * d_x < t_x:
                accepted = c
                break
            current = target_probs[row] if target_row is None else target_row
            target_row = correction(current, draft_row)
            if not replacement:
                draft_row = draft_row.to(torch.float64).clone()
                draft_row[x] = 0.0
                mass = float(draft_row.sum())
                if mass > 0.0:
                    draft_row /= mass
        if accepted < 0:  # every child rejected: correction from the current residual
            return Verdict(path=path, next_token=sample_from(target_row, generator), state=state)
        path.append(accepted)
        row = accepted + 1


# ------------------------------------------------------------------------------------- consultant


def tree_consultant(
    tokens: torch.Tensor,
    parents,
    target_probs: torch.Tensor,
    state: Any,
    verifier,
    generator: torch.Generator | None = None,
    sample_probs: torch.Tensor | None = None,
) -> Verdict:
    """Consultant Decoding (paper Algorithm 1, eqs. 6-8) along every root-to-leaf path, with
    ``verifier``'s ``eps``, ``beta`` and ``greedy`` (a ``ConsultantVerifier``, which checked them).

    Each path runs its own EMA from the carried state r_0 (``state``, 0 when None): at node i with
    parent a, r_i = EMA_beta(r_a, -log p_target(x_i)) (r_a = r_0 for a child of the root), and node i
    passes when its parent passes and r_i <= eps; the EMA is that of the path, so siblings never see
    each other's NLLs. Accepted: the deepest passing node's path (ties: highest summed target
    log-likelihood of the path, then first in node order). Lines 16-17: the target's token x' at the
    row after that path (argmax of ``target_probs`` if ``greedy``, else a draw from ``sample_probs``
    / ``target_probs``), and the carried state r = EMA_beta(r_path, -log p_target(x')), exactly as
    ``ConsultantVerifier``. ``target_probs`` must be the raw (temperature 1) rows. With the verifier's ``argmax``
    (our extension), a node whose token is the argmax of its parent's row passes whenever its parent does."""
    eps, beta = verifier.eps, verifier.beta
    token_list, parents, _ = _validate(tokens, parents, target_probs, who="tree_consultant")
    r0 = 0.0 if state is None else float(state)
    node_nll = [nll(p) for p in _target_at_nodes(target_probs, token_list, parents)]
    top = argmax_rows(target_probs, sample_probs).tolist() if getattr(verifier, "argmax", False) else None
    r = [0.0] * len(parents)
    passing = [False] * len(parents)
    for i, parent in enumerate(parents):
        if parent >= 0 and not passing[parent]:
            continue
        r_i = ema(beta, r0 if parent < 0 else r[parent], node_nll[i])
        if r_i <= eps or (top is not None and top[parent + 1] == token_list[i]):
            passing[i], r[i] = True, r_i
    node = _deepest(passing, parents, node_nll)
    token = target_token(target_probs, sample_probs, node + 1, verifier.greedy, generator)
    r_path = r0 if node < 0 else r[node]
    r_next = ema(beta, r_path, nll(float(target_probs[node + 1, token])))
    return Verdict(path=path_to(parents, node), next_token=token, state=r_next)


# ------------------------------------------------------------------------------- token by token


def tree_per_token(
    tokens: torch.Tensor,
    parents,
    target_probs: torch.Tensor,
    accepts: Callable[[int, int, float], bool],
    greedy: bool,
    generator: torch.Generator | None = None,
    sample_probs: torch.Tensor | None = None,
    state: Any = None,
    who: str = "tree_per_token",
) -> Verdict:
    """The tree form of any rule that judges each drafted token alone, at its own row: node i (token x,
    parent a) passes when a passes (or i is a child of the root) and ``accepts(a + 1, x, p_target(x))``
    (the row index into ``target_probs``, the token, its probability there; called in node order, only
    for nodes whose parent passed). Accepted: the deepest passing node's path, ties to the highest
    summed target log-likelihood (Medusa's rule), then node order. ``next_token``: argmax of the row
    after the path if ``greedy``, else a draw from ``sample_probs`` / ``target_probs``. ``state`` is
    passed through. On a chain it is the chain rule "accept while ``accepts``"."""
    token_list, parents, _ = _validate(tokens, parents, target_probs, who=who)
    node_p = _target_at_nodes(target_probs, token_list, parents)
    passing = [False] * len(parents)
    for i, parent in enumerate(parents):
        if parent >= 0 and not passing[parent]:
            continue
        passing[i] = bool(accepts(parent + 1, token_list[i], node_p[i]))
    node = _deepest(passing, parents, [nll(p_x) for p_x in node_p])
    token = target_token(target_probs, sample_probs, node + 1, greedy, generator)
    return Verdict(path=path_to(parents, node), next_token=token, state=state)


# ---------------------------------------------------------------------------------------- typical


def tree_typical(
    tokens: torch.Tensor,
    parents,
    target_probs: torch.Tensor,
    state: Any,
    verifier,
    generator: torch.Generator | None = None,
    sample_probs: torch.Tensor | None = None,
) -> Verdict:
    """Medusa typical acceptance (Cai et al. 2024, section 2.3.1) along every root-to-leaf path, with
    ``verifier``'s ``eps``, ``delta`` and ``greedy`` (a ``TypicalVerifier``).

    Node i with parent a passes when a passes (or i is a child of the root) and
    p_target(x_i) > min(eps, delta * exp(-H(p_target row a+1))); the threshold is
    ``verifier.thresholds`` (the chain verifier's helper, computed only for rows where some
    child has p_target(x) <= eps). The rest is :func:`tree_per_token`'s. ``target_probs`` must be the
    raw rows; ``state`` is passed through."""
    thresholds: dict[int, float] = {}

    def accepts(row: int, token: int, p_x: float) -> bool:
        if p_x > verifier.eps:
            return True
        if row not in thresholds:
            thresholds[row] = float(verifier.thresholds(target_probs[row : row + 1])[0])
        return p_x > thresholds[row]

    return tree_per_token(tokens, parents, target_probs, accepts, verifier.greedy, generator, sample_probs, state,
                          who="tree_typical")


__all__ = [
    "chain_as_tree",
    "children_of",
    "depths",
    "paths",
    "tree_consultant",
    "tree_greedy",
    "tree_per_token",
    "tree_sample",
    "tree_typical",
]
