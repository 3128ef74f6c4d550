"""Packaging: the wheel carries every kernel module (kernels/ is installed as fa2_jax.kernels), its
license and type marker; a checkout that was not installed says how to install it; ``import fa2_jax``
stays light."""
from __future__ import annotations

import pathlib
import subprocess
import sys
import zipfile

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_wheel_contains_kernels_and_installs(tmp_path):
  """One wheel build (two at once would share the tree's build/ folder): it carries every module,
  and installed, it imports from elsewhere; from the clone, whose source folder then comes first on
  the path, the error names the shadowing and the two ways out."""
  subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                  "-w", str(tmp_path), str(ROOT)], check=True, capture_output=True)
  (wheel,) = tmp_path.glob("fa2_jax-*.whl")
  names = set(zipfile.ZipFile(wheel).namelist())
  kernel_files = {f"fa2_jax/{p.relative_to(ROOT).as_posix()}" for p in (ROOT / "kernels").rglob("*.py")}
  public = {f"fa2_jax/{p.relative_to(ROOT / 'fa2_jax').as_posix()}"
            for p in (ROOT / "fa2_jax").rglob("*.py")}
  assert "fa2_jax/flax/attention.py" in public
  for module in sorted(kernel_files | public | {"fa2_jax/py.typed"}):
    assert module in names, (module, sorted(names))
  assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), sorted(names)
  assert not any(n.startswith("kernels/") for n in names)  # never a top-level `kernels` package
  site = tmp_path / "site"
  subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                  "--target", str(site), str(wheel)], check=True, capture_output=True)
  import jax
  jax_site = str(pathlib.Path(jax.__file__).parents[1])
  env = {"JAX_PLATFORMS": "cpu", "PYTHONPATH": f"{site}:{jax_site}"}
  run = lambda cwd: subprocess.run(  # noqa: E731
      [sys.executable, "-S", "-c", "import sys; sys.path.insert(0, ''); import fa2_jax; "
       "print(fa2_jax.__file__)"], cwd=cwd, capture_output=True, text=True, env=env, timeout=300)
  r = run(ROOT)
  assert r.returncode != 0
  last = r.stderr.strip().splitlines()[-1]
  assert "shadows the installed package" in last and "run from outside the clone" in last, last
  r = run(tmp_path)
  assert r.returncode == 0, r.stderr
  assert r.stdout.strip().startswith(str(site)), r.stdout


def test_kernels_import_under_package_name():
  from fa2_jax.kernels.triton import backward, forward
  assert callable(forward.forward) and callable(backward.backward)


def _run(code: str, cwd: pathlib.Path, installed: bool = True, **env):
  """Python in a fresh process. ``installed=False``: it sees the source tree but no installed fa2_jax
  (``-S`` drops site-packages' editable-install finder; jax comes back through PYTHONPATH)."""
  import jax
  site = str(pathlib.Path(jax.__file__).parents[1])
  flags = [] if installed else ["-S"]
  return subprocess.run([sys.executable, *flags, "-c", code], cwd=cwd, capture_output=True, text=True,
                        env={"PYTHONPATH": f"{cwd}:{site}", "JAX_PLATFORMS": "cpu", **env},
                        timeout=300)


def test_a_checkout_that_was_not_installed_names_the_install_step():
  """kernels/ becomes fa2_jax.kernels only by installing (no import-path hack): a checkout imported
  without it raises one ImportError that gives the command."""
  r = _run("import fa2_jax", ROOT, installed=False)
  assert r.returncode != 0
  last = r.stderr.strip().splitlines()[-1]
  assert last.startswith("ImportError: fa2_jax was imported from the source folder"), r.stderr
  assert "install the checkout first" in last and "pip install -e" in last, r.stderr


def test_import_is_light():
  """``import fa2_jax`` loads the configs, not the kernel modules (nor flax)."""
  r = _run("import sys, fa2_jax; print(sorted(m for m in sys.modules if m.startswith(('fa2_jax', "
           "'flax'))))", ROOT)
  assert r.returncode == 0, r.stderr
  loaded = eval(r.stdout)  # noqa: S307 - our own printout
  assert not [m for m in loaded if m.endswith(("forward", "backward", ".ops")) or "flax" in m], loaded
