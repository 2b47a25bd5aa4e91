import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(scope="module", autouse=True)
def no_ray_left_behind():
    """A module whose Serve failed to start never reaches its own teardown; Ray left running
    would then fail every later module's `ray.init` ("called twice"), hiding the one failure
    behind dozens. So Ray still up at a module's end is shut down here."""
    yield
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        from ray import serve

        try:
            serve.shutdown()
        finally:
            ray.shutdown()
