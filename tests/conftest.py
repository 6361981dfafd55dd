"""Shared fixtures: a tiny random Llama target, a tiny sliding-window Gemma 3 (both fast), and the real SmolLM2
through the converted cache (slow)."""
from __future__ import annotations

import os

import pytest
import torch

# Two intra-op threads when the suite runs in one process; one per worker when pytest-xdist runs it on several
# (`make test` does: -n auto), so the workers do not oversubscribe the cores.
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture
def tiny():
    """Random-weight 4-layer Llama, hidden 64, vocab 256, fp32. No tokenizer."""
    from specheads.target import tiny_target

    return tiny_target()


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct in fp32 from the converted cache (converted on first use, ~20 s)."""
    from specheads import load_target

    return load_target("smollm2-135m", dtype="float32")


@pytest.fixture(scope="session")
def smol_tokenizer(smollm2):
    return smollm2.tokenizer


@pytest.fixture
def one_thread():
    """One intra-op thread for tests made of many small sequential ops (several times faster on a shared CPU)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def sliding():
    """Random-weight 4-layer Gemma 3, hidden 64, vocab 256, fp32: layers 0-2 sliding-window (window 8), layer 3
    full attention, RoPE per layer type. No tokenizer."""
    from specheads.target import tiny_gemma3_target

    return tiny_gemma3_target()
