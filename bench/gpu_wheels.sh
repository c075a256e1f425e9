#!/usr/bin/env bash
# Fill .whl/ (repo root, git-ignored) with what `kvpool bench gpu` needs on the GPU machine
# and that machine lacks: run HERE (a machine that reaches PyPI), before the device call.
#
# The GPU machine (Python 3.12, x86-64, torch 2.11 + CUDA 13, cupy-cuda13x, msgpack, xxhash,
# prometheus-client, httpx, anyio, h11, click, numpy, cuda-core, cuda-bindings, nvidia-ml-py)
# reaches no registry. kvpool's runtime dependencies (pyproject.toml) it lacks: lmdb (the SSD
# tier; kvpool.embedded imports it), starlette and uvicorn (kvpool serve), safetensors,
# tokenizers and jinja2 + markupsafe (kvpool serve --model PATH: Hugging Face checkpoints). UCX: ucxx-cu13 and
# its native parts libucxx-cu13, libucx-cu13 (libucxx 0.52 wants libucx <1.22), rmm-cu13,
# librmm-cu13, rapids-logger. kvpool itself travels as a wheel built from this checkout (its
# package-dir mapping needs an install; PYTHONPATH=. is not enough).
#
# About 56 MiB in all (libucx is 42 of it): under the 64 MiB a device call may carry.
# Usage: bash bench/gpu_wheels.sh   (then: the device call in bench/gpu_check.sh's header)
set -euo pipefail
cd "$(dirname "$0")/.."
dest=.whl
rm -rf "$dest"
mkdir -p "$dest"
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 \
         manylinux_2_17_x86_64 manylinux2014_x86_64; do
  platforms+=(--platform "$p")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp "${platforms[@]}" -d "$dest" \
  lmdb==3.0.0 starlette==1.10.0 uvicorn==0.54.0 \
  safetensors==0.8.0 tokenizers==0.22.2 jinja2==3.1.6 markupsafe==3.0.3 \
  ucxx-cu13==0.52.0 libucxx-cu13==0.52.0 libucx-cu13==1.21.0 \
  rmm-cu13==26.10.0 librmm-cu13==26.10.0 rapids-logger==0.3.0
python3 -m pip wheel -q --no-deps -w "$dest" .
ls -l "$dest"
du -sh "$dest"
