#!/usr/bin/env bash
# The house rule of one direction of dependency, checked on the sources:
# coordinator/ includes of worker/ only the step-executor seam (worker/api/),
# worker/rank/executor_factory.h and worker/comm/comm_factory.h (the rank
# group's collective settings), never models or kernels; kernels/ includes
# nothing of coordinator/, worker/ or sharding/.
set -euo pipefail
SRC=${EXL3_SOURCE_DIR:-$(cd "$(dirname "$0")/../.." && pwd)}
fail=0
bad=$(grep -rnE '#include "(worker/(model|rank/(local_group|rank_executor|rank_server|rank_client))|kernels/(cpu|cuda|ops|trellis_decode|hadamard))' \
      "$SRC/coordinator" --include='*.h' --include='*.cc' || true)
if [ -n "$bad" ]; then echo "coordinator/ reaches past the seam:"; echo "$bad"; fail=1; fi
bad=$(grep -rnE '#include "(coordinator|worker|sharding)/' "$SRC/kernels" \
      --include='*.h' --include='*.cc' --include='*.cu' || true)
if [ -n "$bad" ]; then echo "kernels/ includes a higher layer:"; echo "$bad"; fail=1; fi
[ $fail = 0 ] && echo "layering: OK"
exit $fail
