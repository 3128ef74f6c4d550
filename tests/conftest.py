"""Test configuration: 4 CPU devices for pmap/shard_map tests, and the GPU/CPU switch.

One suite: on a CPU-only machine the kernels run in Pallas interpret mode on small shapes; on a GPU the
same tests run compiled, and the tests marked ``gpu`` add bigger shapes (``pytest -m gpu``).
"""
import jax
import pytest

# Must happen before the first use of jax's backends.
jax.config.update("jax_num_cpu_devices", 4)


def on_gpu() -> bool:
  return jax.default_backend() == "gpu"


def pytest_collection_modifyitems(config, items):
  if on_gpu():
    return
  skip = pytest.mark.skip(reason="compiled-kernel test: needs a GPU (run `pytest -m gpu` there)")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)
