#!/usr/bin/env bash
# One entry point for people and CI:
#   ./run.sh demo [flags]    set up .venv if needed, run the main job on a local emulated fleet
#   ./run.sh test [pytest args]  set up .venv if needed, lint, run the tests
set -euo pipefail
cd "$(dirname "$0")"

PYTHON=${PYTHON:-python3}
VENV=.venv
STAMP=$VENV/.installed-from

setup() {
  # (Re)install when the venv is missing or pyproject.toml changed since the last install.
  local want
  want=$(sha256sum pyproject.toml | cut -d' ' -f1)
  if [ -x "$VENV/bin/python" ] && [ "$(cat "$STAMP" 2>/dev/null)" = "$want" ]; then
    return
  fi
  "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' || {
    echo "pathways-ray needs Python >= 3.11; set PYTHON=/path/to/python3.11" >&2; exit 1; }
  echo "setting up $VENV (first run takes a minute or two) ..." >&2
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/pip" install --quiet --upgrade pip
  "$VENV/bin/pip" install --quiet -e ".[test]"
  echo "$want" > "$STAMP"
}

cmd=${1:-}
shift || true
case "$cmd" in
  demo)
    setup
    exec "$VENV/bin/pathways-ray" demo "$@"
    ;;
  test)
    setup
    "$VENV/bin/ruff" check .
    exec "$VENV/bin/python" -m pytest "$@"
    ;;
  *)
    echo "usage: ./run.sh demo [flags] | ./run.sh test [pytest args]" >&2
    exit 2
    ;;
esac
