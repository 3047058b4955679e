"""A served tiny model for the serving tests: ``server`` (one per test) and ``module_server``
(one per module, for tests that only validate)."""
from __future__ import annotations

import pytest

from selectinfer_ros.core.options import ModelOptions
from selectinfer_ros.core.serving.runtime import Runtime
from selectinfer_ros.core.serving.server import Server


def served_tiny_llama(tiny_models, tiny_profiles, load_ratio: float = 0.7,
                      compute_ratio: float = 0.5, queue_length: int = 1, max_batch: int = 1):
    """A started Server holding the tiny Llama (by default at gamma 0.7 / phi 0.5, queue of one,
    goals one at a time)."""
    _, packed = tiny_models["tiny-llama"]
    opts = ModelOptions(model=str(packed), profiles=str(tiny_profiles["tiny-llama"]), task="alpha",
                        load_ratio=load_ratio, compute_ratio=compute_ratio, context_limit=64)
    srv = Server(queue_length=queue_length, max_batch=max_batch)
    srv.start()
    try:
        srv.load(lambda: Runtime(opts))
        srv.accepting = True
        yield srv
    finally:
        srv.stop(timeout=10.0)


@pytest.fixture
def server(tiny_models, tiny_profiles):
    yield from served_tiny_llama(tiny_models, tiny_profiles)


@pytest.fixture(scope="module")
def module_server(tiny_models, tiny_profiles):
    yield from served_tiny_llama(tiny_models, tiny_profiles)


@pytest.fixture
def batch_server(tiny_models, tiny_profiles):
    """The tiny Llama computing every loaded neuron (goals may batch), max_batch 3, queue of 4."""
    yield from served_tiny_llama(tiny_models, tiny_profiles, load_ratio=1.0, compute_ratio=1.0,
                                 queue_length=4, max_batch=3)


@pytest.fixture
def selecting_batch_server(tiny_models, tiny_profiles):
    """The tiny Llama at gamma 0.7 / phi 0.5 (each prompt chooses its neurons), max_batch 3,
    queue of 4."""
    yield from served_tiny_llama(tiny_models, tiny_profiles, load_ratio=0.7, compute_ratio=0.5,
                                 queue_length=4, max_batch=3)
