#!/usr/bin/env bash
# The device side of the GPU kit (tools/gpu/kit.py prints the calls): `bash tools/gpu/device.sh 1`, then 2
# (campaign mode: `... 2 --campaign EXPERIMENT`, then `... 3 --campaign EXPERIMENT`); where the working tree is
# large, stash calls `... 0 --carried .gpukit/stashN` go first.
# Uses the machine's own python3 (its torch and transformers); results and logs go to $OUT.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/eaglet-kit-out}
mkdir -p "$OUT"
nvidia-smi -L >"$OUT/nvidia-smi.txt" 2>&1 || true
exec python3 -m tools.gpu.device "$@" --profile gpu --out "$OUT"
