#!/usr/bin/env bash
# The test tiers beyond CI's default run (`python -m pytest -q`):
#   slow  heavy tests (`-m "slow and not dev"`): the 30 s load test, the full lm-eval harness run
#   dev   tests that need the dev extra, torch and transformers (`-m dev`, slow ones included)
# First installs the requirements of the test and dev extras (not the package itself: run from
# the repository root, the tests import this checkout). Every tier runs, then the script prints
# how long each took and exits non-zero if any tier failed or collected no test. A missing
# dependency is a failure, never a skip.
#   bash scripts/test_slow.sh [more pytest arguments]
set -uo pipefail
cd "$(dirname "$0")/.."

mapfile -t requirements < <(python - <<'EOF'
import tomllib

with open("pyproject.toml", "rb") as f:
    extras = tomllib.load(f)["project"]["optional-dependencies"]
print("\n".join(extras["test"] + extras["dev"]))
EOF
)
echo "installing the test and dev extras: ${requirements[*]}"
python -m pip install -q "${requirements[@]}" || exit 1

summary=()
failed=0
run_tier() {
    local name=$1 marker=$2
    shift 2
    echo "=== tier ${name}: pytest -m \"${marker}\""
    local start=$SECONDS
    python -m pytest -q -m "${marker}" "$@"
    local rc=$?  # 5 (no test collected) counts as a failure too
    summary+=("tier ${name}: exit ${rc} in $((SECONDS - start)) s")
    [[ ${rc} -eq 0 ]] || failed=1
}

run_tier slow "slow and not dev" "$@"
run_tier dev "dev" "$@"
printf '%s\n' "${summary[@]}"
exit ${failed}
