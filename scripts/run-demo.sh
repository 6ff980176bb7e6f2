#!/usr/bin/env bash
# The main job on its built-in default: installs Debian packages, builds, and
# runs `exl3serve` with no arguments (today: converts a small built-in model
# with deterministic random weights and prints its per-layer bits and errors).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
bash scripts/build.sh
BUILD_DIR=${EXL3_BUILD_DIR:-build}
exec "$BUILD_DIR/cli/exl3serve" "$@"
