#!/usr/bin/env bash
# The real-backbone calibration and study on one CUDA GPU, in calls of at most BUDGET seconds each (default 540: a
# machine lent for 10-minute calls). Each call goes on where the last one stopped (the study engine reuses every
# finished step; a step cut by the budget runs again from its start), so call it until it prints "finished".
#
#     bash scripts/gpu_study_real.sh calibrate     # experiments/configs/calibrate_real.yaml -> runs/gpu/calibrate-real
#     bash scripts/gpu_study_real.sh study         # experiments/configs/study_real.yaml     -> runs/gpu/study-real
#
# What differs from the CPU run: models load and train on the GPU, and the recipe trains in bf16 autocast with fp32
# master weights (precision auto; the CPU run's recipe says fp32) while every eval and Sink-Strength pass loads the
# models in float32: S is computed in float32 (bf16 probabilities cap the log-odds near 5.5). The configs are written
# beside the outputs (OUT/gpu_config.yaml, OUT/gpu_recipe.yaml), so every figure names what made it.
# Needs the project installed with a CUDA torch and the real checkpoints (make real-model; the Hugging Face hub is not
# needed). GPU_STUDY_SMOKE=1 runs the same path on the CPU with the quick configs (to check the script without a GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
what=${1:-}
case "$what" in
    calibrate) config=calibrate_real ;;
    study) config=study_real ;;
    *) echo "usage: bash scripts/gpu_study_real.sh calibrate|study" >&2; exit 2 ;;
esac
SMOKE=${GPU_STUDY_SMOKE:-0}
[ "$SMOKE" = 1 ] && config=${config}_quick
PY=${PYTHON:-.venv/bin/python}
OUT=${OUT:-runs/gpu/${config//_/-}}
BUDGET=${BUDGET:-540}
"$PY" -c "import os, torch; assert os.environ.get('GPU_STUDY_SMOKE') == '1' or torch.cuda.is_available(), 'no CUDA device'" \
    || { echo "gpu_study_real: $PY has no CUDA device (GPU_STUDY_SMOKE=1 checks the path on the CPU)" >&2; exit 2; }
names="smollm2-135m-instruct"
[ "$config" = study_real ] && names="smollm2-135m-instruct gemma-3-270m qwen2.5-coder-0.5b-instruct"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 SINKSTUDY_NUMERICS=native
"$PY" -m sinkstudy.real_weights --chat --link-dir "$OUT/inputs" --quiet $names
[ "$config" = study_real ] && "$PY" -m experiments.demo.corpus "$OUT/inputs/text_chats.jsonl"
"$PY" - "$config" "$OUT" "$SMOKE" <<'EOF'
import sys
from pathlib import Path

import yaml

config, out, smoke = sys.argv[1], Path(sys.argv[2]), sys.argv[3] == "1"
raw = yaml.safe_load(Path(f"experiments/configs/{config}.yaml").read_text())
recipe = yaml.safe_load((Path("experiments/configs") / raw["adapt"]["recipe"]).read_text())
recipe["precision"] = "fp32" if smoke else "auto"  # bf16 autocast on a bf16 GPU
(out / "gpu_recipe.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
raw["adapt"]["recipe"] = str((out / "gpu_recipe.yaml").resolve())
raw["model"] = {"dtype": "float32", "device": "cpu" if smoke else "cuda"}
raw["name"] = f"{raw['name']}-gpu"
(out / "gpu_config.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
EOF
set +e
timeout --signal=INT "$BUDGET" "$PY" -m experiments.cli run "$OUT/gpu_config.yaml" --out "$OUT" --numerics native --quiet
rc=$?
set -e
if [ $rc = 0 ]; then
    echo "gpu_study_real: finished; report in $OUT/report.md"
elif [ $rc = 124 ] || [ $rc = 130 ]; then
    echo "gpu_study_real: stopped at the ${BUDGET}s budget; call again to go on"
else
    exit $rc
fi
