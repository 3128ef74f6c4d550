"""Test configuration: 4 CPU devices for pmap/shard_map tests, and the GPU/CPU switch.

One suite: on a CPU-only machine the kernels run in Pallas interpret mode on small shapes; on a GPU the
same tests run compiled, and the tests marked ``gpu`` add bigger shapes (``pytest -m gpu``).
"""
import atexit
import os
import shutil
import tempfile

# fa2_jax reuses kernel lowerings across programs and processes by default, in a per-user folder: the
# suite keeps the default on, in a folder of its own (not the user's cache; removed when the session
# that made it ends, pytest-xdist's workers sharing it), unless the environment names one
# (FA2_JAX_CACHE_DIR=off runs it with the default off).
if "FA2_JAX_CACHE_DIR" not in os.environ:
  os.environ["FA2_JAX_CACHE_DIR"] = tempfile.mkdtemp(prefix="fa2_jax_test_kernels_")
  atexit.register(shutil.rmtree, os.environ["FA2_JAX_CACHE_DIR"], ignore_errors=True)

import jax  # noqa: E402
import pytest  # noqa: E402

# Must happen before the first use of jax's backends.
jax.config.update("jax_num_cpu_devices", 4)

# JAX's strict numpy modes, for the whole session: no implicit rank promotion (a broadcast between
# arrays of different ranks raises) and no implicit dtype promotion (mixing dtypes raises), settings
# a user may run with; every path (formula, kernels, sharding, Flax, the GPT example) must work
# under them, and running the suite so keeps it that way. FA2_TEST_STRICT=0 runs with JAX's defaults.
if os.environ.get("FA2_TEST_STRICT", "1") != "0":
  jax.config.update("jax_numpy_rank_promotion", "raise")
  jax.config.update("jax_numpy_dtype_promotion", "strict")

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


def _heads_first(items, is_first, workers):
  """``items`` reordered so that those ``is_first`` picks start first: at the heads of the ``workers``
  contiguous shares that xdist's worksteal schedule hands out (share i gets ``remaining // (workers -
  i)`` items), round robin; every other item keeps its order."""
  chosen = [x for x in items if is_first(x)]
  rest = iter([x for x in items if not is_first(x)])
  out, remaining = [], len(items)
  for i in range(workers):
    share = remaining // (workers - i)
    remaining -= share
    heads = chosen[i::workers]
    out += heads + [x for _, x in zip(range(share - len(heads)), rest)]
  return out + list(rest)


@pytest.hookimpl(trylast=True)  # after `-m` has deselected: the shares are of the tests that run
def pytest_collection_modifyitems(config, items):
  # FA2_TEST_FIRST=SUBSTR[,SUBSTR...] (scripts/gpu.sh passes it on): the tests whose node id contains
  # one of them start first, so that the few long-compiling GPU tests do not lengthen the tail of a
  # time-limited device call. Under pytest-xdist's worksteal schedule (gpu.sh's) each worker first gets
  # a contiguous share of the collection, so such tests go to the heads of the shares, round robin.
  first = [s for s in os.environ.get("FA2_TEST_FIRST", "").split(",") if s]
  if first:
    items[:] = _heads_first(items, lambda item: any(s in item.nodeid for s in first),
                            int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
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
