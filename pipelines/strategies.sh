#!/usr/bin/env bash
# Train the demo model once per exchange strategy and print each run's final eval line,
# a quick end-to-end comparison on the embedded dataset (make data first).
# Usage: pipelines/strategies.sh [N] [EPOCHS]
set -euo pipefail
N=${1:-2}
EPOCHS=${2:-3}
cd "$(dirname "$0")/.."
make venv
for s in ar asa32 asa16 copper; do
    .venv/bin/tmpi train -n "$N" --strategy "$s" --epochs "$EPOCHS" --run-dir "runs/digits-$s"
    .venv/bin/tmpi eval -n "$N" --run-dir "runs/digits-$s" | tail -n 3
done
