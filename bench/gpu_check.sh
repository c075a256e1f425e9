#!/usr/bin/env bash
# kvpool bench gpu on the GPU machine, in one device call. Prepare here first:
#
#     bash bench/gpu_wheels.sh          # fills .whl/ (git-ignored), ~52 MiB
#
# then the device call (tool `run`), from the repo root of the checkout the session started in:
#
#     command:   bash bench/gpu_check.sh
#     carry:     [".whl"]
#     timeout_s: 450
#
# It installs the carried wheels into /tmp/site (--no-deps: the machine has the rest), records
# the machine's facts, and runs every section within --total-budget (360 s by default), so the
# call ends in ~8 minutes including start-up, and one rerun of the failing sections still fits in
# the 15 minutes of device time:  bash bench/gpu_check.sh --only serve,ucx
# Extra arguments go to `kvpool bench gpu`. Results come back from $OUT: gpu_check.json,
# gpu_check.log, machine.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=$(realpath -m "${OUT:-bench/out/gpu}")
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || { echo "installing the carried wheels failed"; exit 3; }
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 UCX_WARN_UNUSED_ENV_VARS=n
cd /tmp  # import kvpool from /tmp/site, never from the source tree's unmapped folders
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
  python3 -m pip show cuda-core cuda-bindings nvidia-ml-py httpx numpy torch cupy-cuda13x \
    2>/dev/null | grep -E '^(Name|Version):'
  df -h /dev/shm /tmp
  ulimit -l
  python3 -c 'import kvpool, lmdb, ucxx, starlette, uvicorn; print("imports ok", kvpool.__file__)'
} >"$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"
timeout "${GPU_CHECK_TIMEOUT:-420}" python3 -m kvpool bench gpu --out "$OUT" "$@"
rc=$?
echo "kvpool bench gpu exited $rc"
exit $rc
