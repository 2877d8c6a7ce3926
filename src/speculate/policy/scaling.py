"""The Chinchilla estimate of a model's converged loss, for Consultant Decoding's threshold ε.

Consultant Decoding paper (``shared/seeds/consultant-decoding-paper.txt``), §3.3 "How to Determine
Generic Threshold ε", eq. 9 (Hoffmann et al. 2022's fit):

    L(N, D) = E + A / N^α + B / D^β,   E = 1.69, A = 406.4, B = 410.7, α = 0.34, β = 0.28

with N the parameter count and D the training tokens. The paper sets ε to this convergence loss
(rounded to 2.0 for the models it tried). The α here is the scaling exponent, not an acceptance rate.
"""

from __future__ import annotations

import math

from ..errors import SpeculateError

CHINCHILLA_E = 1.69
CHINCHILLA_A = 406.4
CHINCHILLA_B = 410.7
CHINCHILLA_ALPHA = 0.34
CHINCHILLA_BETA = 0.28


def chinchilla_terms(n_params: float, n_tokens: float) -> tuple[float, float, float]:
    """(E, A/N^α, B/D^β) of eq. 9: the irreducible loss, the model-size term and the data term."""
    for name, v in (("the parameter count N", n_params), ("the training tokens D", n_tokens)):
        if not 0.0 < float(v) < math.inf:
            raise SpeculateError(f"{name} must be finite and > 0, got {v:g}")
    return (CHINCHILLA_E, CHINCHILLA_A / float(n_params) ** CHINCHILLA_ALPHA,
            CHINCHILLA_B / float(n_tokens) ** CHINCHILLA_BETA)


def chinchilla_loss(n_params: float, n_tokens: float) -> float:
    """L(N, D) = E + A/N^α + B/D^β (Consultant Decoding paper, eq. 9), in nats per token."""
    return math.fsum(chinchilla_terms(n_params, n_tokens))
