#!/bin/sh
# Cold-start wall time of `tmpi train` (empty compile cache; one step) at N=1 and N=4 on this
# machine: compile once per node (today) vs one compile per rank (the old per-rank caches).
#   pipelines/cold_start.sh DATA [MODEL]        e.g. pipelines/cold_start.sh data/digits digits
set -eu
DATA=${1:?usage: $0 DATA [MODEL]}
MODEL=${2:-digits}
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
unset PYTENSOR_FLAGS
run() {  # label, then the command
  label=$1; shift
  rm -rf "$TMP/cache"
  start=$(date +%s.%N)
  THEANOMPI_CACHE="$TMP/cache" "$@" --model "$MODEL" --data "$DATA" --run-dir "$TMP/run" \
      --max-steps 1 --epochs 1 --set output.snapshot_freq=0 >"$TMP/log" 2>&1 || { cat "$TMP/log"; exit 1; }
  end=$(date +%s.%N)
  rm -rf "$TMP/run"
  echo "$label $(echo "$end - $start" | bc)"
}
run "N=1" tmpi train -n 1
run "N=4_per_node" tmpi train -n 4
# the old layout: every rank its own cache folder (user PYTENSOR_FLAGS win over ours)
run "N=4_per_rank" mpirun -n 4 --oversubscribe --bind-to none sh -c \
  'PYTENSOR_FLAGS=base_compiledir=$THEANOMPI_CACHE/rank$OMPI_COMM_WORLD_RANK exec "$0" "$@"' \
  "$(command -v python)" -m theanompi.cli train
