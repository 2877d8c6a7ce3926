"""Shared fixtures: tiny random models saved as ordinary HF folders, and the real default model."""

from __future__ import annotations

import copy
import shutil

import pytest
import torch

from speculate import load_model
from speculate.models.loader import QUANTIZED, quantized_cache_folder
from speculate.models.tiny import save_tiny_model


@pytest.fixture(scope="session")
def tiny_folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    folders = {seed: save_tiny_model(root / f"seed{seed}", seed=seed) for seed in (0, 1, 2)}
    yield folders
    # Tests that load these at int8 without a cache of their own quantize into the user's cache, under this
    # session's temporary paths: remove those entries, or every run would leave new ones behind.
    for folder in folders.values():
        for kind in QUANTIZED:
            shutil.rmtree(quantized_cache_folder(str(folder), folder, kind), ignore_errors=True)


@pytest.fixture(scope="session")
def tiny(tiny_folders):
    """seed → LoadedModel (loaded once per session)."""
    return {seed: load_model(str(folder)) for seed, folder in tiny_folders.items()}


def noisy_copy(loaded, scale: float, seed: int = 123):
    """A draft model: the target's weights plus Gaussian noise. Agrees with the target often, not always."""
    draft = copy.deepcopy(loaded)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale * p.std().clamp_min(1e-3))
    return draft


@pytest.fixture(scope="session")
def default_model():
    """The embedded default (SmolLM2-135M-Instruct), converted once into the cache."""
    return load_model()
