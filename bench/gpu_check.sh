#!/usr/bin/env bash
# One command that checks nanolm's CUDA paths on the GPU at hand, in about 8 minutes on one GPU:
#
#   bash bench/gpu_check.sh            # PYTHON=... to use another interpreter; OUT=dir for the JSON figures
#
# 1. `pytest -m gpu` (tests/test_gpu.py): bf16 and compiled training steps against the eager float32 reference,
#    fused AdamW, SDPA's backends, DDP and FSDP over NCCL with one process, resuming on the GPU, the engine's rows
#    decoded together against each alone, the server.
# 2. bench/throughput.py at gpt2-124m in bfloat16, eager and compiled: training tokens/s (MFU against this
#    run's measured matmul ceiling), batch-1 decoding against the weight-pass floor, and batched decoding at 1 to
#    64 rows; then the training MFU against the GPU's datasheet bf16 peak (nanolm/train/metrics.py).
#
# Targets (issue: nothing silently corrupt, nothing stuck, and the GPU path checked): gpt2-124m bf16 compiled
# training at least 40% MFU; batch-1 decoding at most 1.3x the weight-pass floor.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
OUT=${OUT:-$(mktemp -d /tmp/nanolm-gpu-check-XXXX)}
mkdir -p "$OUT"
"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA GPU is visible to torch here')"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
export CUBLAS_WORKSPACE_CONFIG=:4096:8  # cuBLAS reductions in a fixed order: resumed runs sum as the first did
"$PY" -m pytest -q -m gpu tests/test_gpu.py
PYTHONPATH=. "$PY" bench/throughput.py --preset gpt2-124m --device cuda --dtypes bfloat16 \
    --parts matmul,train,generate,batch --compile --seq-len 1024 --batch-size 8 --steps 10 --warmup 3 \
    --batch-sizes 1,2,4,8,16,32,64 --json-out "$OUT/throughput.json" >"$OUT/throughput.txt"
cat "$OUT/throughput.txt" | grep -v '^{'
"$PY" - "$OUT/throughput.json" <<'PYEOF'
import json, sys
import torch
from nanolm.config import preset
from nanolm.model.transformer import flops_per_token
from nanolm.train.metrics import peak_flops
res = json.load(open(sys.argv[1]))
peak, where = peak_flops(torch.device("cuda"), torch.bfloat16)
fpt = flops_per_token(preset("gpt2-124m").model, res["train_shape"]["seq_len"])
for r in res["train"]:
    if not r.get("error"):
        print(f"gpt2-124m train {r['dtype']} compile={r['compile']}: {r['tokens_per_s']:,.0f} tokens/s = "
              f"{100 * r['tokens_per_s'] * fpt / peak:.1f}% MFU of {peak / 1e12:.0f} TFLOP/s ({where}); target 40%")
for g in res["generate"]:
    print(f"batch-1 decoding {g['dtype']}: {1000 * g['decode_s_per_token']:.2f} ms/token, "
          f"{g['floor_ratio']:.2f}x the weight-pass floor; target 1.3x")
PYEOF
echo "figures: $OUT"
