#!/bin/sh
# A simulated two-node cluster on this machine (root; network namespaces + a veth pair):
#   pipelines/netns_cluster.sh up [DIR]   build it, print the hostfile / mpirun arguments, wait
#                                         (Ctrl-C tears it down)
#   pipelines/netns_cluster.sh clean      remove namespaces left by a crashed run
# Run a job from the head node, e.g.:
#   ip netns exec <ns-a> unshare --uts sh -c 'hostname nodea && exec tmpi train -n 4 \
#       --hostfile DIR/hostfile --mpi-args "<printed mpi args>"'
set -eu
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
case "${1:-}" in
  up) exec "$PY" -m theanompi.launch.simcluster up "${2:-/tmp/theanompi-simcluster}" ;;
  clean) exec "$PY" -m theanompi.launch.simcluster clean ;;
  *) echo "usage: $0 up [DIR] | clean" >&2; exit 2 ;;
esac
