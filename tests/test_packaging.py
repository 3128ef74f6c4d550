"""Packaging: the wheel carries every kernel module (kernels/ is installed as fa2_jax.kernels), its
license and type marker; a checkout runs without installing; ``import fa2_jax`` stays light."""
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
  kernel_files = {f"fa2_jax/{p.relative_to(ROOT).as_posix()}" for p in (ROOT / "kernels").rglob("*.py")}
  public = {f"fa2_jax/{p.name}" for p in (ROOT / "fa2_jax").glob("*.py")}
  for module in sorted(kernel_files | public | {"fa2_jax/py.typed"}):
    assert module in names, (module, sorted(names))
  assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), sorted(names)
  assert not any(n.startswith("kernels/") for n in names)  # never a top-level `kernels` package


def test_kernels_import_under_package_name():
  from fa2_jax.kernels.triton import backward, forward
  assert callable(forward.forward) and callable(backward.backward)


def _run(code: str, cwd: pathlib.Path, **env):
  """Python in a fresh process that sees the source tree but no installed fa2_jax (``-S`` drops
  site-packages' editable-install finder; jax comes back through PYTHONPATH)."""
  import jax
  site = str(pathlib.Path(jax.__file__).parents[1])
  return subprocess.run([sys.executable, "-S", "-c", code], cwd=cwd, capture_output=True, text=True,
                        env={"PYTHONPATH": f"{cwd}:{site}", "JAX_PLATFORMS": "cpu", **env},
                        timeout=300)


def test_checkout_runs_without_installation():
  r = _run("import fa2_jax, fa2_jax.kernels.triton.forward as f, fa2_jax.kernels.sm90.backward;"
           "print(f.__file__)", ROOT)
  assert r.returncode == 0, r.stderr
  assert r.stdout.strip() == str(ROOT / "kernels" / "triton" / "forward.py")


def test_import_is_light():
  """``import fa2_jax`` loads the configs, not the kernel modules (nor flax)."""
  r = _run("import sys, fa2_jax; print(sorted(m for m in sys.modules if m.startswith(('fa2_jax', "
           "'flax'))))", ROOT)
  assert r.returncode == 0, r.stderr
  loaded = eval(r.stdout)  # noqa: S307 - our own printout
  assert not [m for m in loaded if m.endswith(("forward", "backward", ".ops")) or "flax" in m], loaded
