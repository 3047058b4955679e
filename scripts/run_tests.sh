#!/usr/bin/env bash
# Set up (idempotent, seconds when up to date), then run the test suite.
# Usage: bash scripts/run_tests.sh [pytest args...]   (default: the whole test/ tree)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

bash scripts/setup.sh

set +u  # activate/setup.bash scripts are not nounset-clean
# shellcheck disable=SC1091
source scripts/env.sh
set -u

# A random DDS domain per run keeps concurrent runs (and other machines) apart.
if [ -z "${ROS_DOMAIN_ID:-}" ]; then
  ROS_DOMAIN_ID=$(( (RANDOM % 100) + 1 ))
fi
export ROS_DOMAIN_ID
echo "[tests] ROS_DOMAIN_ID=$ROS_DOMAIN_ID ROS_AUTOMATIC_DISCOVERY_RANGE=$ROS_AUTOMATIC_DISCOVERY_RANGE"

if [ "$#" -eq 0 ]; then set -- test; fi
rc=0
python -m pytest -q --durations=12 "$@" || rc=$?
if [ "$rc" -eq 5 ]; then
  echo "[tests] FAILED: pytest collected no tests (exit 5)" >&2
  exit 1
fi
exit "$rc"
