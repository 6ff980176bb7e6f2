#!/usr/bin/env bash
# Runs tests/bench/allreduce_bench (our shm all-reduce against OpenMPI's
# MPI_Allreduce on the same ranks) for N = 2, 3 and 4 ranks on this box and
# prints one table per N. Extra arguments go to the benchmark, e.g.
#   tests/bench/allreduce_bench.sh --max-bytes=4194304 --dtypes=f32
# Environment: EXL3_BUILD_DIR (default build/), RANKS (default "2 3 4").
# Oversubscription is allowed (ranks may outnumber cores), as on the 2-core CI box.
set -euo pipefail
cd "$(dirname "$0")/../.."
build="${EXL3_BUILD_DIR:-build}"
bin="$build/tests/allreduce_bench"
if [[ ! -x "$bin" ]]; then
  echo "allreduce_bench.sh: $bin not found (build it: cmake --build $build --target allreduce_bench;" \
       "it needs MPI: scripts/install-deps.sh installs libopenmpi-dev openmpi-bin)" >&2
  exit 1
fi
echo "# $(date -u +%Y-%m-%dT%H:%MZ) $(nproc) CPUs, load average $(cut -d' ' -f1-3 /proc/loadavg)"
for n in ${RANKS:-2 3 4}; do
  mpirun --allow-run-as-root --oversubscribe -np "$n" "$bin" "$@"
  echo
done
