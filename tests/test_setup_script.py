"""scripts/setup.sh as a new user meets it: the Python it picks or refuses, the .venv it repairs, and
pip run only when pyproject.toml, constraints.txt or the extras changed.

No network and no real virtual environment: each test copies setup.sh and the files it reads into a
temporary folder and hands it stand-in Pythons (bash scripts that print a version, make a fake
``.venv`` for ``-m venv`` and log every call, ``-m pip`` included).
"""
import os
import pathlib
import shutil
import stat
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
BASH = shutil.which("bash")

pytestmark = pytest.mark.skipif(BASH is None, reason="needs bash")

# A stand-in Python: `-c CODE` prints its version (setup.sh asks for nothing else), `-m venv DIR`
# makes DIR/bin/python (a copy of itself) and DIR/bin/pip (whose shebang names DIR/bin/python), and
# `-m pip ...` fails when FAKE_PIP_FAIL is set. Every call is appended to $FAKE_LOG.
FAKE_PYTHON = """#!/usr/bin/env bash
echo "$0 $*" >> "$FAKE_LOG"
case "$1" in
  -c) echo "{version}" ;;
  -m) case "$2" in
        venv) mkdir -p "$3/bin" && cp "$0" "$3/bin/python" \\
                && printf '#!%s/bin/python\\n' "$(cd "$3" && pwd)" > "$3/bin/pip" ;;
        pip) if [ -n "${{FAKE_PIP_FAIL:-}}" ] && [ "$3" = install ] && [ "$4" = -c ]; then
               echo "ERROR: No matching distribution found for jax==0.11.2"; exit 1
             fi ;;
      esac ;;
esac
"""


def fake_python(path: pathlib.Path, version: str) -> str:
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(FAKE_PYTHON.format(version=version))
  path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
  return str(path)


@pytest.fixture
def repo(tmp_path):
  """A folder with what setup.sh reads: scripts/setup.sh, pyproject.toml, constraints.txt and
  .python-version."""
  repo = tmp_path / "repo"
  (repo / "scripts").mkdir(parents=True)
  shutil.copy(ROOT / "scripts" / "setup.sh", repo / "scripts" / "setup.sh")
  for name in ("pyproject.toml", "constraints.txt", ".python-version"):
    shutil.copy(ROOT / name, repo / name)
  return repo


def setup(repo, *args, python=None, path=None, **env):
  """Runs setup.sh; (returncode, stdout, stderr, the calls of the stand-in Pythons)."""
  log = repo.parent / "calls.log"
  log.write_text("")
  environ = {k: v for k, v in os.environ.items() if k not in ("PYTHON", "VIRTUAL_ENV")}
  environ.update(FAKE_LOG=str(log), **env)
  if python is not None:
    environ["PYTHON"] = python
  if path is not None:
    environ["PATH"] = path
  done = subprocess.run([BASH, str(repo / "scripts" / "setup.sh"), *args], env=environ,
                        capture_output=True, text=True, timeout=60)
  return done.returncode, done.stdout, done.stderr, log.read_text().splitlines()


def pip_installs(calls):
  return [c.split(" -m pip install ", 1)[1] for c in calls if " -m pip install -c " in c]


def test_python_version_file_is_a_minor_version():
  assert (ROOT / ".python-version").read_text().strip() == "3.12"


def test_installs_once_then_only_when_files_or_extras_change(repo, tmp_path):
  py = fake_python(tmp_path / "bin" / "python3.12", "3.12.1")
  rc, out, err, calls = setup(repo, "examples", python=py)
  assert rc == 0, err
  assert calls[0] == f"{py} -c import sys; print(\"%d.%d.%d\" % sys.version_info[:3])"
  assert f"{py} -m venv .venv" in calls
  assert pip_installs(calls) == ["-c constraints.txt -e .[examples]"]
  assert out.splitlines() == [
      "scripts/setup.sh: installing fa2_jax[examples] into .venv, pinned by constraints.txt (the "
      "first time: a minute or two; pip's log: .venv/setup.log)"]
  assert err == ""
  # Again: no pip, no output, and the system Python is not even asked.
  rc, out, err, calls = setup(repo, "examples", python=py)
  assert (rc, out, err) == (0, "", "") and pip_installs(calls) == []
  assert not any(c.startswith(py) for c in calls)
  # Extras already installed: nothing; new extras: installed with the old ones.
  assert pip_installs(setup(repo, "test,examples,bench", python=py)[3]) == [
      "-c constraints.txt -e .[bench,examples,test]"]
  assert pip_installs(setup(repo, "examples", python=py)[3]) == []
  assert pip_installs(setup(repo, "bench, test", python=py)[3]) == []
  # A changed constraints.txt (or pyproject.toml): pip again, with every extra installed before.
  with open(repo / "constraints.txt", "a") as f:
    f.write("# a comment changes the checksum\n")
  assert pip_installs(setup(repo, "examples", python=py)[3]) == [
      "-c constraints.txt -e .[bench,examples,test]"]
  assert pip_installs(setup(repo, "examples", python=py)[3]) == []
  # No extras at all: the package alone.
  shutil.rmtree(repo / ".venv")
  assert pip_installs(setup(repo, "", python=py)[3]) == ["-c constraints.txt -e ."]


def test_failed_pip_is_shown_and_retried(repo, tmp_path):
  py = fake_python(tmp_path / "bin" / "python3.12", "3.12.1")
  rc, out, err, _ = setup(repo, "examples", python=py, FAKE_PIP_FAIL="1")
  assert rc == 1
  assert err.startswith('scripts/setup.sh: pip install -c constraints.txt -e ".[examples]" failed; '
                        "the end of .venv/setup.log:\n")
  assert "ERROR: No matching distribution found for jax==0.11.2" in err
  assert not (repo / ".venv" / "fa2_jax-setup.stamp").exists()
  rc, _, err, calls = setup(repo, "examples", python=py)  # the next call tries again
  assert rc == 0 and pip_installs(calls) == ["-c constraints.txt -e .[examples]"]


@pytest.mark.parametrize("breakage, problem", [
    ("old", "its Python is 3.11.7, fa2_jax needs 3.12 or newer"),
    ("dangling", "its bin/python does not run"),
    ("no_pip", "it has no pip (its creation failed)"),
    ("moved", "its scripts belong to another folder: they run /elsewhere/.venv/bin/python"),
])
def test_a_broken_venv_is_made_again(repo, tmp_path, breakage, problem):
  """A .venv made once with a Python that is too old (the old setup.sh fell back to python3), whose
  bin/python is gone, whose creation stopped before pip, or copied from another checkout."""
  old = fake_python(tmp_path / "bin" / "python3.11", "3.11.7")
  py = fake_python(tmp_path / "bin" / "python3.12", "3.12.1")
  assert setup(repo, "examples", python=old if breakage == "old" else py)[0] == (
      1 if breakage == "old" else 0)  # the old Python is refused: make its .venv by hand
  if breakage == "old":
    subprocess.run([old, "-m", "venv", ".venv"], cwd=repo, check=True,
                   env=dict(os.environ, FAKE_LOG=os.devnull))
  venv_bin = repo / ".venv" / "bin"
  if breakage == "dangling":
    (venv_bin / "python").unlink()
    (venv_bin / "python").symlink_to(tmp_path / "gone" / "python3.12")
  elif breakage == "no_pip":
    (venv_bin / "pip").unlink()
  elif breakage == "moved":
    (venv_bin / "pip").write_text("#!/elsewhere/.venv/bin/python\n")
  rc, out, err, calls = setup(repo, "examples", python=py)
  assert rc == 0, err
  assert out.splitlines()[0] == (f"scripts/setup.sh: .venv cannot be used ({problem}): making it "
                                 f"again with {py} (3.12.1)")
  assert f"{py} -m venv .venv" in calls
  assert pip_installs(calls) == ["-c constraints.txt -e .[examples]"]
  assert "3.12.1" in (venv_bin / "python").read_text()
  assert setup(repo, "examples", python=py)[1:3] == ("", "")  # and now it stays


def test_a_venv_with_spaces_in_its_path_is_not_made_again(tmp_path):
  """pip writes a /bin/sh launcher for an interpreter path with spaces; it is read as the same
  folder."""
  repo = tmp_path / "a folder" / "repo"
  (repo / "scripts").mkdir(parents=True)
  shutil.copy(ROOT / "scripts" / "setup.sh", repo / "scripts")
  for name in ("pyproject.toml", "constraints.txt", ".python-version"):
    shutil.copy(ROOT / name, repo / name)
  py = fake_python(tmp_path / "bin" / "python3.12", "3.12.1")
  assert setup(repo, python=py)[0] == 0
  (repo / ".venv" / "bin" / "pip").write_text(
      f"#!/bin/sh\n'''exec' \"{repo}/.venv/bin/python\" \"$0\" \"$@\"\n' '''\n")
  (repo / ".venv" / "fa2_jax-setup.stamp").unlink()  # so that pip runs: the venv must be kept
  rc, out, err, calls = setup(repo, python=py)
  assert rc == 0 and "cannot be used" not in out and f"{py} -m venv .venv" not in calls


def test_python_too_old_or_broken_is_refused_in_one_line(repo, tmp_path):
  old = fake_python(tmp_path / "bin" / "python3.11", "3.11.7")
  rc, out, err, _ = setup(repo, "examples", python=old)
  assert rc == 1 and out == "" and not (repo / ".venv").exists()
  assert err.splitlines() == [
      f"scripts/setup.sh: PYTHON={old} is Python 3.11.7, fa2_jax needs 3.12 or newer; set PYTHON "
      "to a Python 3.12 or newer, or unset it"]
  rc, out, err, _ = setup(repo, python=str(tmp_path / "missing"))
  assert rc == 1 and err.splitlines() == [
      f"scripts/setup.sh: PYTHON={tmp_path / 'missing'} does not run; set PYTHON to a Python 3.12 "
      "or newer, or unset it"]


def tool_dir(tmp_path) -> pathlib.Path:
  """A folder of links to the tools setup.sh runs, standing in for a PATH without any Python."""
  tools = tmp_path / "tools"
  tools.mkdir()
  for name in ("bash", "env", "cat", "cksum", "sed", "tr", "sort", "paste", "head", "tail", "rm",
               "mkdir", "cp", "dirname", "printf", "pwd"):
    found = shutil.which(name)
    if found:
      (tools / name).symlink_to(found)
  return tools


def test_no_python_found_on_path_is_one_line_naming_the_fix(repo, tmp_path):
  tools = tool_dir(tmp_path)
  fake_python(tools / "python3", "3.10.12")  # the python3 of an older system
  rc, out, err, _ = setup(repo, path=str(tools))
  assert rc == 1 and out == ""
  assert err.splitlines() == [
      "scripts/setup.sh: fa2_jax needs Python 3.12 or newer and found none (python3 is 3.10.12): "
      "install Python 3.12 or newer (e.g. apt install python3.12 python3.12-venv, or pyenv install "
      "3.12), or set PYTHON=/path/to/python3.12"]
  # ... and a python3 that is new enough is taken, without PYTHON.
  py = fake_python(tools / "python3.13", "3.13.0")
  rc, out, err, calls = setup(repo, path=str(tools))
  assert rc == 0, err
  assert f"{py} -m venv .venv" in calls
