#!/usr/bin/env bash
# One prepared script for a CUDA machine: installs, runs the lossless tests, trains the demo head on the GPU
# (the whole demo chain, bf16), then prints the decoding table (oracle-tree losslessness in bf16, the demo
# head's tau and speedup). Everything it writes lands under ${OUT:-/tmp/eaglet-gpu}.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/eaglet-gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 WANDB_MODE=offline HF_HUB_OFFLINE=1
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name())"
make install >"$OUT/install.log" 2>&1 || { tail -30 "$OUT/install.log"; exit 1; }
python -m pytest -q tests/test_lossless.py tests/test_sampling.py tests/test_tree.py 2>&1 | tail -3 | tee "$OUT/lossless.txt"
python -m pipeline.run stage=all experiment=demo output_root="$OUT/outputs" 2>&1 | tail -20 | tee "$OUT/demo.txt"
python bench/gpu_check.py --head-dir "$OUT/outputs/demo/train/eagle3" --out "$OUT/gpu_check.json" | tee "$OUT/table.txt"
