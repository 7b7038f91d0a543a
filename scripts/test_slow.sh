#!/usr/bin/env bash
# The test tiers beyond CI's default run (`python -m pytest -q`):
#   slow  heavy tests (`-m "slow and not dev"`): the 30 s load test, the full lm-eval harness run
#   dev   tests that need the dev extra, torch and transformers (`-m dev`, slow ones included),
#         and the sm_90 compile of the GPU build (a venv with the `cuda` extra, made here)
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

# The GPU build is compiled for sm_90 by the dev tier (tests/program/test_cuda_compile.py) with
# jax's CUDA plugin, which lives in a venv of its own (beside the CPU-only test environment it
# would try to start a GPU backend): made once, then reused.
cuda_venv="${NINFER_CUDA_VENV:-${TMPDIR:-/tmp}/ninfer-cuda-venv}"
if [[ ! -x "${cuda_venv}/bin/python" ]] || ! "${cuda_venv}/bin/python" -c "import jax_plugins.xla_cuda12" 2>/dev/null; then
    echo "making ${cuda_venv} (pip install -e '.[cuda]')"
    python -m venv "${cuda_venv}" && "${cuda_venv}/bin/pip" install -q -e '.[cuda]' || exit 1
fi
export NINFER_CUDA_PYTHON="${cuda_venv}/bin/python"

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
