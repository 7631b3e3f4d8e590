"""Shared fixtures: a session-wide data cache so the built-in tokenizer and corpus are prepared once."""

from __future__ import annotations

import os

import pytest

# every test world (forked ranks and launched runs inherit it): the part of an in-place reduce-scatter's input that
# a rank does not own reads NaN after the collective, where gloo's fast path leaves it reduced and NCCL leaves it
# local, so code reading it fails here rather than on a GPU (megazero/distributed/group.py)
os.environ.setdefault("MEGAZERO_POISON_REDUCE_SCATTER", "1")
# every test world and launched run computes fp32 matmuls in fp32 on a GPU: the recipe would otherwise turn TF32
# back on in each rank from the config's --tf32 default, and parity at 1e-5 fails (megazero/train/recipe.py)
os.environ.setdefault("MEGAZERO_TF32", "0")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items) -> None:
    """A test skipped for want of CUDA is a GPU test: it joins ``-m gpu`` (the set bench/gpu_check.sh runs) even
    where its file does not mark it. Runs before ``-m`` deselects."""
    for item in items:
        for mark in item.iter_markers("skipif"):
            reason = str(mark.kwargs.get("reason", "")).lower()
            if "cuda" in reason or "gpu" in reason:
                item.add_marker(pytest.mark.gpu)
                break


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
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout under test comes first
    env.update(MEGAZERO_CACHE=data_cache, WANDB_MODE="disabled", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(x for x in (root, env.get("PYTHONPATH")) if x))
    return env


@pytest.fixture(scope="session")
def reference(data_cache):
    """The independent reference of tests/common.py's small GPT (global batch 8): Hugging Face GPT-2,
    torch.optim.AdamW, clip_grad_norm_ and LambdaLR in one process (tests/reference.py), as
    (losses, full final state under megazero's names). Computed once per session."""
    from tests.reference import run_reference

    ref = run_reference(data_cache)
    return ref.losses, ref.final
