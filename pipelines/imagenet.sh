#!/usr/bin/env bash
# Full ImageNet pipeline: prep on N ranks, AlexNet BSP training on N workers, eval.
# Usage: pipelines/imagenet.sh /path/to/ILSVRC2012 [N] [STRATEGY]
#   The tree must hold train/<wnid>/*.JPEG, val/*.JPEG and a ground-truth file (see docs/prep.md).
set -euo pipefail
SRC=${1:?usage: pipelines/imagenet.sh /path/to/imagenet [N] [STRATEGY]}
N=${2:-8}
STRATEGY=${3:-asa32}
DATA=${DATA:-data/imagenet}
RUN=${RUN:-runs/alexnet-$STRATEGY-n$N}
cd "$(dirname "$0")/.."
make venv
TMPI=.venv/bin/tmpi
$TMPI prep all -n "$N" --src "$SRC" --out "$DATA" --size 256
$TMPI train -n "$N" --model alexnet --strategy "$STRATEGY" --data "$DATA" --run-dir "$RUN" \
    --set data.image_size=256
$TMPI eval -n "$N" --model alexnet --data "$DATA" --run-dir "$RUN" --set data.image_size=256
$TMPI plot "$RUN"
