#!/usr/bin/env bash
# The wheels bench/gpu.sh needs on a GPU machine that has no network: the Python packages diffexp imports that a
# GPU image with torch, lightning, tensorboard, tokenizers, ... often lacks. Run it where pip reaches the registry,
# then copy the folder .whl/ (ignored through .git/info/exclude) with the checkout to the GPU machine (docs/gpu.md).
#   bash bench/gpu_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || { mkdir -p .git/info; echo /.whl/ >> .git/info/exclude; }
mkdir -p .whl
# jsonargparse[signatures] (LightningCLI's parser) and its two extras; pure-Python wheels, any platform
python3 -m pip download -q --no-deps --only-binary=:all: -d .whl \
  "jsonargparse>=4.32" docstring-parser typeshed-client
ls -l .whl
