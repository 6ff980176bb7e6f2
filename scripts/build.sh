#!/usr/bin/env bash
# Configures and builds exl3serve into ${EXL3_BUILD_DIR:-build} (Ninja, RelWithDebInfo).
# CUDA sources compile whenever nvcc is found (sm_80, sm_90); no GPU needed.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${EXL3_BUILD_DIR:-build}
JOBS=${EXL3_JOBS:-$(nproc)}
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo "$@" >/dev/null
cmake --build "$BUILD_DIR" -j"$JOBS"
