#!/usr/bin/env bash
# The whole test suite: installs Debian packages, builds, runs every test
# (unit tests, CLI end-to-end tests, a short fuzz run). CI runs exactly this.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
bash scripts/build.sh
BUILD_DIR=${EXL3_BUILD_DIR:-build}
ctest --test-dir "$BUILD_DIR" --output-on-failure --timeout 900 -j2
