"""Shared fixtures: a session-wide data cache so the built-in tokenizer and corpus are prepared once."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory) -> str:
    """A cache directory with the built-in corpus' tokenizer (vocab 512) and token cache already built."""
    from megazero.data import build_datasets, resolve_tokenizer

    cache = str(tmp_path_factory.mktemp("megazero-cache"))
    tok = resolve_tokenizer([], 512, cache)
    build_datasets([], tok, 32, cache)
    return cache


@pytest.fixture(scope="session")
def subprocess_env(data_cache) -> dict[str, str]:
    """Environment for launching pretrain/gpt.py in tests: shared cache, W&B off, one thread per rank."""
    env = dict(os.environ)
    env.update(MEGAZERO_CACHE=data_cache, WANDB_MODE="disabled", OMP_NUM_THREADS="1")
    return env


@pytest.fixture(scope="session")
def reference(data_cache, tmp_path_factory):
    """The single-process reference run of tests/common.py's small GPT: (losses, full final state)."""
    from tests.common import REFERENCE_FLAGS, train_runs
    from tests.dist import run_world

    [(losses, state)] = run_world(train_runs, 1, [REFERENCE_FLAGS], data_cache,
                                  str(tmp_path_factory.mktemp("reference")))[0]
    return losses, state
