"""A served tiny model for the serving tests: ``server`` (one per test) and ``module_server``
(one per module, for tests that only validate)."""
from __future__ import annotations

import pytest

from selectinfer_ros.core.options import ModelOptions
from selectinfer_ros.core.serving.runtime import Runtime
from selectinfer_ros.core.serving.server import Server


def _served_tiny_llama(tiny_models, tiny_profiles):
    """A started Server holding the tiny Llama at gamma 0.7 / phi 0.5, queue of one."""
    _, packed = tiny_models["tiny-llama"]
    opts = ModelOptions(model=str(packed), profiles=str(tiny_profiles["tiny-llama"]), task="alpha",
                        load_ratio=0.7, compute_ratio=0.5, context_limit=64)
    srv = Server(queue_length=1)
    srv.start()
    try:
        srv.load(lambda: Runtime(opts))
        srv.accepting = True
        yield srv
    finally:
        srv.stop(timeout=10.0)


@pytest.fixture
def server(tiny_models, tiny_profiles):
    yield from _served_tiny_llama(tiny_models, tiny_profiles)


@pytest.fixture(scope="module")
def module_server(tiny_models, tiny_profiles):
    yield from _served_tiny_llama(tiny_models, tiny_profiles)
