"""The wheel carries every kernel module (kernels/ is installed as fa2_jax.kernels)."""
from __future__ import annotations

import pathlib
import subprocess
import sys
import zipfile

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_wheel_contains_kernels(tmp_path):
  subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                  "-w", str(tmp_path), str(ROOT)], check=True, capture_output=True)
  (wheel,) = tmp_path.glob("fa2_jax-*.whl")
  names = set(zipfile.ZipFile(wheel).namelist())
  for module in ("fa2_jax/__init__.py", "fa2_jax/attention.py", "fa2_jax/masking.py",
                 "fa2_jax/kernels/__init__.py", "fa2_jax/kernels/triton/forward.py",
                 "fa2_jax/kernels/triton/backward.py", "fa2_jax/kernels/mosaic/__init__.py"):
    assert module in names, (module, sorted(names))
  assert not any(n.startswith("kernels/") for n in names)  # never a top-level `kernels` package


def test_kernels_import_under_package_name():
  import fa2_jax.kernels.triton as tk
  assert callable(tk.forward) and callable(tk.backward)
