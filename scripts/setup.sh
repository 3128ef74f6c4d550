#!/usr/bin/env bash
# Create (or repair) .venv and install fa2_jax into it, editable, with the given extras, pinned by
# constraints.txt. Usage: bash scripts/setup.sh "test,examples,bench"   (default: examples)
#
# - Python: the version of .python-version or newer (3.12 and up); $PYTHON when set (only that one),
#   else the first of python3.12 (from .python-version), python3.13, python3.14, python3, python that
#   runs and is new enough. None: one line saying what to install, exit status 1.
# - A .venv whose Python is too old, whose bin/python does not run, that has no pip (a failed
#   creation) or that was copied or moved from another folder (its scripts point there) is made
#   again.
# - pip runs only when something it depends on changed: .venv/fa2_jax-setup.stamp records a checksum
#   of pyproject.toml and constraints.txt and the extras installed; a later call with the same
#   files and extras already installed returns at once (delete the stamp to force a reinstall).
#   pip's output goes to .venv/setup.log; when it fails, its last lines are printed.
set -euo pipefail
cd "$(dirname "$0")/.."
me="scripts/setup.sh"
stamp=.venv/fa2_jax-setup.stamp
log=.venv/setup.log

# The minimum Python: .python-version's major.minor (3.12).
min=3.12
if [ -f .python-version ] && [[ "$(head -n 1 .python-version)" =~ ^([0-9]+\.[0-9]+) ]]; then
  min="${BASH_REMATCH[1]}"
fi

version_of() {  # PYTHON -> its version (3.12.1) on stdout; fails when it does not run
  "$1" -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])' 2>/dev/null
}

new_enough() {  # VERSION -> whether VERSION >= $min
  [[ "$1" =~ ^([0-9]+)\.([0-9]+) ]] || return 1
  local major="${BASH_REMATCH[1]}" minor="${BASH_REMATCH[2]}"
  [[ "$min" =~ ^([0-9]+)\.([0-9]+) ]]
  [ "$major" -gt "${BASH_REMATCH[1]}" ] \
    || { [ "$major" -eq "${BASH_REMATCH[1]}" ] && [ "$minor" -ge "${BASH_REMATCH[2]}" ]; }
}

find_python() {  # sets py and py_version, or exits with one line naming the fix
  local fix="install Python $min or newer (e.g. apt install python$min python$min-venv, or pyenv install $min)"
  if [ -n "${PYTHON:-}" ]; then
    py="$PYTHON"
    if ! py_version="$(version_of "$py")"; then
      echo "$me: PYTHON=$PYTHON does not run; set PYTHON to a Python $min or newer, or unset it" >&2
      exit 1
    fi
    if ! new_enough "$py_version"; then
      echo "$me: PYTHON=$PYTHON is Python $py_version, fa2_jax needs $min or newer; set PYTHON to" \
           "a Python $min or newer, or unset it" >&2
      exit 1
    fi
    return
  fi
  local tried=() candidate version
  for candidate in "python$min" python3.13 python3.14 python3 python; do
    command -v "$candidate" >/dev/null 2>&1 || continue
    if version="$(version_of "$candidate")"; then
      if new_enough "$version"; then
        py="$candidate" py_version="$version"
        return
      fi
      tried+=("$candidate is $version")
    else
      tried+=("$candidate does not run")
    fi
  done
  local found="no python3 on PATH"
  if [ "${#tried[@]}" -gt 0 ]; then found="$(IFS=,; echo "${tried[*]}" | sed 's/,/, /g')"; fi
  echo "$me: fa2_jax needs Python $min or newer and found none ($found): $fix, or set" \
       "PYTHON=/path/to/python$min" >&2
  exit 1
}

venv_problem() {  # why .venv cannot be used as it is (empty: it can)
  local version
  if ! version="$(version_of .venv/bin/python)"; then
    echo "its bin/python does not run"
  elif ! new_enough "$version"; then
    echo "its Python is $version, fa2_jax needs $min or newer"
  elif [ ! -f .venv/bin/pip ]; then
    echo "it has no pip (its creation failed)"
  else
    # pip's script names the interpreter it was installed for: another folder's if .venv was copied
    # or moved (a long path or one with spaces: `'''exec' "PATH" "$0" "$@"` on its second line)
    local first="" second="" target
    { IFS= read -r first; IFS= read -r second; } < .venv/bin/pip || true
    if [ "$first" = "#!/bin/sh" ]; then
      target="${second#*exec\' \"}"
      target="${target%%\"*}"
    else
      target="${first#\#!}"
    fi
    if ! [ "$(dirname "$target")" -ef .venv/bin ]; then
      echo "its scripts belong to another folder: they run $target"
    fi
  fi
}

# Normalised extras: sorted, unique, comma-separated.
normalise() { tr ', ' '\n\n' | sed '/^$/d' | sort -u | paste -sd, -; }
wanted="$(printf '%s' "${1-examples}" | normalise)"
key="$(cat pyproject.toml constraints.txt | cksum)"

if [ -e .venv ] || [ -L .venv ]; then
  problem="$(venv_problem)"
  if [ -n "$problem" ]; then
    find_python
    echo "$me: .venv cannot be used ($problem): making it again with $py ($py_version)"
    rm -rf .venv
  fi
fi

if [ ! -e .venv ]; then
  [ -n "${py:-}" ] || find_python
  if ! out="$("$py" -m venv .venv 2>&1)"; then
    rm -rf .venv
    echo "$me: $py -m venv .venv failed: $(printf '%s\n' "$out" | sed '/^\s*$/d' | tail -n 1)" \
         "(on Debian/Ubuntu: apt install python${py_version%.*}-venv)" >&2
    exit 1
  fi
  problem="$(venv_problem)"
  if [ -n "$problem" ]; then
    rm -rf .venv
    echo "$me: $py -m venv .venv made a virtual environment that cannot be used ($problem)" >&2
    exit 1
  fi
  .venv/bin/python -m pip install --upgrade pip > "$log" 2>&1 || true  # the old pip works too
fi

# Nothing to do when pyproject.toml and constraints.txt are unchanged and the extras are installed.
installed=""
if [ -f "$stamp" ] && [ "$(sed -n 's/^key //p' "$stamp")" = "$key" ]; then
  installed="$(sed -n 's/^extras //p' "$stamp")"
  all="$(printf '%s,%s' "$installed" "$wanted" | normalise)"
  if [ "$all" = "$installed" ]; then
    exit 0
  fi
elif [ -f "$stamp" ]; then  # the files changed: install again what was installed before, too
  installed="$(sed -n 's/^extras //p' "$stamp")"
fi
extras="$(printf '%s,%s' "$installed" "$wanted" | normalise)"
spec="."
if [ -n "$extras" ]; then spec=".[$extras]"; fi

echo "$me: installing fa2_jax${extras:+[$extras]} into .venv, pinned by constraints.txt" \
     "(the first time: a minute or two; pip's log: $log)"
rm -f "$stamp"
# On a GPU machine install the CUDA plugin too: pip install -c constraints.txt "jax[cuda13]==0.11.2"
if ! .venv/bin/python -m pip install -c constraints.txt -e "$spec" > "$log" 2>&1; then
  echo "$me: pip install -c constraints.txt -e \"$spec\" failed; the end of $log:" >&2
  tail -n 25 "$log" >&2
  exit 1
fi
printf 'key %s\nextras %s\n' "$key" "$extras" > "$stamp"
