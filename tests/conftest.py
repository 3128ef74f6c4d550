"""Test configuration: 4 CPU devices for pmap/shard_map tests, and the GPU/CPU switch.

One suite: on a CPU-only machine the kernels run in Pallas interpret mode on small shapes; on a GPU the
same tests run compiled, and the tests marked ``gpu`` add bigger shapes (``pytest -m gpu``).
"""
import os

import jax
import pytest

# Must happen before the first use of jax's backends.
jax.config.update("jax_num_cpu_devices", 4)

# Hypothesis profiles of the property-based suite (tests/test_fuzz.py); HYPOTHESIS_PROFILE picks one:
#   ci (default): derandomized (the same examples on every run), 8 examples per property (scaled by
#     each property's weight in test_fuzz.py), about 1.5 minutes of CPU, no shrinking (a failure is printed as drawn, and the run stays bounded);
#   ci-shrink: the ci examples, with failures minimised;
#   long: fresh random examples, many of them (on demand);
#   gpu: for `pytest -m gpu` on a GPU machine (compiled kernels, T/S up to 2k), derandomized, no
#     shrinking (time on a GPU machine is short), ~5 min.
# deadline=None: an example's time is dominated by compiling its shape, which varies by seconds.
try:
  from hypothesis import HealthCheck, Phase, settings
except ImportError:  # hypothesis is in the `test` extra; only test_fuzz.py needs it
  pass
else:
  _slow = [HealthCheck.too_slow, HealthCheck.data_too_large]
  settings.register_profile("ci-shrink", max_examples=8, derandomize=True, deadline=None,
                            suppress_health_check=_slow, print_blob=True)
  settings.register_profile("ci", settings.get_profile("ci-shrink"),
                            phases=[Phase.explicit, Phase.generate])
  settings.register_profile("long", max_examples=500, deadline=None, suppress_health_check=_slow,
                            print_blob=True)
  settings.register_profile("gpu", settings.get_profile("ci"), max_examples=10)
  settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def on_gpu() -> bool:
  return jax.default_backend() == "gpu"


def pytest_collection_modifyitems(config, items):
  if on_gpu():
    return
  skip = pytest.mark.skip(reason="compiled-kernel test: needs a GPU (run `pytest -m gpu` there)")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)


# FA2_TEST_DURATIONS=FILE (scripts/gpu.sh sets it): each test's outcome and seconds are appended to FILE
# as it finishes, one line per test from every pytest-xdist worker, so that a run stopped by a time
# limit still tells what ran, what passed and how long each took (pytest's own --durations and
# summary are printed only at the end).
_durations_file = None


def pytest_configure(config):
  global _durations_file
  xdist_controller = (getattr(config.option, "dist", "no") != "no"
                      and "PYTEST_XDIST_WORKER" not in os.environ)  # its workers write the lines
  if os.environ.get("FA2_TEST_DURATIONS") and not xdist_controller:
    _durations_file = os.environ["FA2_TEST_DURATIONS"]


def pytest_runtest_logreport(report):
  if _durations_file and (report.when == "call" or (report.when == "setup" and not report.passed)):
    with open(_durations_file, "a") as f:  # one short append per line: workers do not interleave
      f.write(f"{report.outcome}\t{report.duration:.1f}\t{report.nodeid}\n")
