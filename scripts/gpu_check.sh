#!/usr/bin/env bash
# sinkstudy's GPU check (issue 16.6): the paths CI cannot run, on one CUDA GPU, from a clean checkout.
# About 3.5 minutes of checks on one H200 (measured 2026-12-04; set-up and installs timed apart); never a test dependency.
#
#   scripts/gpu_check.sh [RESULTS]            (default RESULTS: runs/gpu_check; logs and JSON land there)
#
# 1. sink pass: fast (SDPA + chunked log-sum-exp) vs eager output_attentions on a random-init
#    Qwen3-8B-shape model, bf16, T = 512 / 2048 / 4096: time and peak-memory ratios eager / fast.
# 2. streaming extraction: `make bench-extract` (peak memory / LM bytes on a locally built
#    multi-shard VLM), where this checkout has that target.
# 3. vLLM: `sinkstudy eval --backend vllm` of a small random Llama on sinkstudy_ifeval, beside the
#    HF backend on the same GPU (per-prompt output agreement; bf16 kernels differ, so some may differ).
# 4. mergekit: one TIES merge with `sinkstudy merge --cuda` beside the same merge on the CPU.
# One table at the end. Exit status 1 when a check failed (a skipped check says why).
#
# Python: on a GPU machine without network, the wheels of .whl/ (built where PyPI is reachable with
# scripts/gpu_wheels.sh and copied over with the checkout: docs/adapt.md) are installed into /tmp/site without
# an index and the machine's python3 (its CUDA torch) runs everything (scripts/gpu_site.sh). Elsewhere: $PYTHON if set (it needs sinkstudy's dependencies and a CUDA
# torch); else .venv-gpu, made here with --system-site-packages so a CUDA torch already installed is
# reused, then `pip install -e .` (offline: WHEELS=DIR holding the wheels). vLLM: used where importable,
# else installed into .venv-vllm (vLLM pins its own torch and transformers) where there is a network;
# where that fails the vLLM row says so.
# GPU_CHECKS="merge" (any of sink extract eval merge): only those checks, e.g. to rerun one in a short lease.
# GPU_CHECK_SMOKE=1: the same script on the CPU with tiny shapes, to check it without a GPU (the 8B sink
# shape, the >= 1B extraction bench, vLLM and --cuda are skipped).
set -u -o pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_site.sh
SMOKE=${GPU_CHECK_SMOKE:-0}
RESULTS=${1:-runs/gpu_check}
mkdir -p "$RESULTS" && RESULTS=$(cd "$RESULTS" && pwd)  # absolute: "$PWD/$RESULTS" below must not nest /tmp/... in the checkout
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
export SINKSTUDY_CACHE="$RESULTS/cache" PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
CHECKS=" ${GPU_CHECKS:-sink extract eval merge} "  # a subset reruns only those (a short lease)
wanted() { [[ "$CHECKS" == *" $1 "* ]]; }
ROWS="$RESULTS/rows.tsv"
printf 'check\tstatus\tfigures\tseconds\n' > "$ROWS"
row() { printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" >> "$ROWS"; }
pip_args=(-q ${WHEELS:+--no-index --find-links "$WHEELS"})
field() { "$PY" -c 'import json, sys; print(json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])[sys.argv[2]])' "$@"; }
last_line() { tail -n 1 "$1" 2>/dev/null | cut -c1-160; }

# ------------------------------------------------------------------------------------------- set-up
t=$SECONDS
VENV=""
if [ -n "${PYTHON:-}" ]; then
    PY=$PYTHON
else
    VENV=.venv-gpu
    [ -x "$VENV/bin/python" ] || python3 -m venv --system-site-packages "$VENV"
    PY=$VENV/bin/python
    if ! "$PY" -c "import sinkstudy, lm_eval, mergekit, evals.lmeval" 2>/dev/null; then
        "$PY" -m pip install "${pip_args[@]}" -e . > "$RESULTS/setup.log" 2>&1 || { echo "set-up failed: see $RESULTS/setup.log"; exit 1; }
    fi
    touch "$VENV/.installed"  # the Makefile's install stamp: make targets below use this venv as it is
fi
if [ "$SMOKE" = 1 ]; then
    GPU="CPU smoke run"
elif ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "no CUDA device visible to $PY: this check needs one GPU"; exit 1
else
    GPU=$("$PY" -c "import torch; print(torch.cuda.get_device_name())")
fi
row "set-up" ok "$GPU, torch $("$PY" -c 'import torch; print(torch.__version__)')" $((SECONDS - t))
T_CHECKS=$SECONDS

# ------------------------------------------------------------------------------------------- 1. sink
if wanted sink; then
    t=$SECONDS
    SINK=(--lengths 512 2048 4096)
    [ "$SMOKE" = 1 ] && SINK=(--lengths 64 128 --device cpu --small)
    if timeout 300 "$PY" scripts/gpu_check.py sink "${SINK[@]}" > "$RESULTS/sink.json" 2> "$RESULTS/sink.log"; then
        "$PY" - "$RESULTS/sink.json" >> "$ROWS" <<'EOF'
import json, sys
d = json.load(open(sys.argv[1]))
for r in d["rows"]:
    f, e = r["fast"], r["eager"]
    print(f"sink pass T={r['T']}\tok\teager/fast time x{r['time_ratio']:.1f} ({e['seconds']:.2f}/{f['seconds']:.2f} s), "
          f"peak memory x{r['memory_ratio']:.1f} ({e['peak_gib']:.1f}/{f['peak_gib']:.2f} GiB); weights {d['weights_gib']:.1f} GiB\t-")
EOF
        row "sink pass (all T)" ok "$(field "$RESULTS/sink.json" shape), bf16" $((SECONDS - t))
    else
        row "sink pass" fail "$(last_line "$RESULTS/sink.log")" $((SECONDS - t))
    fi
fi

# ------------------------------------------------------------------------------------------- 2. extraction
if wanted extract; then
    t=$SECONDS
    if [ "$SMOKE" = 1 ]; then
        row "streaming extraction" skip "smoke run: the bench builds a >= 1B-parameter VLM" 0
    elif timeout 240 "$PY" -m benchmarks.extract > "$RESULTS/extract.log" 2>&1; then  # = make bench-extract
        row "streaming extraction" ok "$(last_line "$RESULTS/extract.log")" $((SECONDS - t))
    else
        row "streaming extraction" fail "$(last_line "$RESULTS/extract.log")" $((SECONDS - t))
    fi
fi

# ------------------------------------------------------------------------------------------- 3. vLLM eval
if wanted eval; then
    t=$SECONDS
    EVAL=(-m experiments.cli eval "$RESULTS/tiny" --tasks sinkstudy_ifeval --limit 40 --max-gen-toks 64 --dtype bfloat16)
    "$PY" scripts/gpu_check.py tiny "$RESULTS/tiny" --hidden 256 --layers 2 > "$RESULTS/tiny.json" 2>> "$RESULTS/eval.log"
    VPY=""
    if [ "$SMOKE" = 1 ]; then
        if timeout 300 "$PY" "${EVAL[@]}" --limit 4 --max-gen-toks 8 --device cpu --out "$RESULTS/eval_hf" --cache-dir "$RESULTS/cache_hf" \
                > "$RESULTS/eval.log" 2>&1; then
            row "hf eval" ok "smoke run: sinkstudy_ifeval x4 on the CPU (vLLM needs a GPU)" $((SECONDS - t))
        else
            row "hf eval" fail "$(last_line "$RESULTS/eval.log")" $((SECONDS - t))
        fi
    elif "$PY" -c "import vllm" 2>/dev/null; then
        VPY=$PY
    elif [ "$GPU_WHEELS" = 1 ]; then
        row "vllm eval" skip "vllm is not importable and .whl/ cannot hold it (it pins its own torch); no network to install it" 0
        if timeout 180 "$PY" "${EVAL[@]}" --device cuda --batch-size 8 --out "$RESULTS/eval_hf" --cache-dir "$RESULTS/cache_hf" > "$RESULTS/eval.log" 2>&1; then
            row "hf eval" ok "sinkstudy_ifeval x40 on CUDA, bf16, batch 8 (the HF side of the vLLM comparison)" $((SECONDS - t))
        else
            row "hf eval" fail "$(last_line "$RESULTS/eval.log")" $((SECONDS - t))
        fi
    else
        ti=$SECONDS
        if { [ -x .venv-vllm/bin/python ] || python3 -m venv .venv-vllm; } \
            && timeout 420 .venv-vllm/bin/python -m pip install "${pip_args[@]}" -e ".[vllm]" > "$RESULTS/vllm_install.log" 2>&1 \
            && .venv-vllm/bin/python -c "import vllm" 2>/dev/null; then
            VPY=.venv-vllm/bin/python
            row "vllm install" ok "$(.venv-vllm/bin/python -c 'import vllm; print("vllm", vllm.__version__)')" $((SECONDS - ti))
        else
            row "vllm eval" skip "vllm is not importable and could not be installed here: $(last_line "$RESULTS/vllm_install.log")" $((SECONDS - ti))
        fi
        t=$SECONDS
    fi
    if [ -n "$VPY" ]; then
        if timeout 300 "$VPY" "${EVAL[@]}" --backend vllm --batch-size auto --out "$RESULTS/eval_vllm" --cache-dir "$RESULTS/cache_vllm" \
                --backend-args gpu_memory_utilization=0.3,max_model_len=2048,enforce_eager=true >> "$RESULTS/eval.log" 2>&1 \
            && timeout 180 "$PY" "${EVAL[@]}" --device cuda --batch-size 8 --out "$RESULTS/eval_hf" --cache-dir "$RESULTS/cache_hf" >> "$RESULTS/eval.log" 2>&1 \
            && "$PY" scripts/gpu_check.py same-outputs "$RESULTS/eval_vllm" "$RESULTS/eval_hf" > "$RESULTS/eval.json"; then
            fig=$("$PY" - "$RESULTS/eval.json" <<'EOF'
import json, sys
d = json.load(open(sys.argv[1]))
m = "prompt_level_strict_acc,none"
print(f"sinkstudy_ifeval x40: vLLM and HF outputs equal on {d['same']}/{d['total']} prompts; prompt-strict "
      f"{d['scores_a']['sinkstudy_ifeval'][m]:.3f} (vLLM) vs {d['scores_b']['sinkstudy_ifeval'][m]:.3f} (HF)")
EOF
    )
            row "vllm eval" ok "$fig" $((SECONDS - t))
        else
            row "vllm eval" fail "$(last_line "$RESULTS/eval.log")" $((SECONDS - t))
        fi
    fi
fi

# ------------------------------------------------------------------------------------------- 4. merge --cuda
if wanted merge; then
    t=$SECONDS
    MERGE=(-m experiments.cli merge --method ties --density 0.2 --base "$RESULTS/mbase" --vlm "$RESULTS/mvlm" --no-eval --force)
    SHAPE=(--hidden 1024 --layers 12)
    [ "$SMOKE" = 1 ] && SHAPE=(--hidden 128 --layers 2)
    if ! { "$PY" scripts/gpu_check.py tiny "$RESULTS/mbase" "${SHAPE[@]}" --seed 1 > /dev/null 2> "$RESULTS/merge.log" \
           && "$PY" scripts/gpu_check.py tiny "$RESULTS/mvlm" "${SHAPE[@]}" --seed 2 > /dev/null 2>> "$RESULTS/merge.log"; }; then
        row "merge --cuda" fail "could not build the pair: $(last_line "$RESULTS/merge.log")" $((SECONDS - t))
    else
        tc=$SECONDS
        ok_cpu=0; timeout 240 "$PY" "${MERGE[@]}" --out "$RESULTS/merge_cpu" >> "$RESULTS/merge.log" 2>&1 && ok_cpu=1
        cpu_s=$((SECONDS - tc)); tg=$SECONDS
        if [ "$SMOKE" = 1 ]; then
            if [ $ok_cpu = 1 ]; then row "merge (CPU)" ok "smoke run: TIES d=0.2 in ${cpu_s}s (--cuda needs a GPU)" $((SECONDS - t))
            else row "merge (CPU)" fail "$(last_line "$RESULTS/merge.log")" $((SECONDS - t)); fi
        elif timeout 180 "$PY" "${MERGE[@]}" --cuda --out "$RESULTS/merge_cuda" >> "$RESULTS/merge.log" 2>&1; then
            gpu_s=$((SECONDS - tg))
            if [ $ok_cpu = 0 ]; then
                row "merge --cuda" ok "TIES d=0.2 on CUDA in ${gpu_s}s (the CPU merge to compare with failed: see $RESULTS/merge.log)" $((SECONDS - t))
            elif "$PY" scripts/gpu_check.py same-weights "$RESULTS/merge_cpu/model" "$RESULTS/merge_cuda/model" \
                --pair "$RESULTS/mbase" "$RESULTS/mvlm" --density 0.2 > "$RESULTS/merge.json" 2>> "$RESULTS/merge.log"; then
                row "merge --cuda" ok "TIES d=0.2, 200M-param pair: CUDA ${gpu_s}s vs CPU ${cpu_s}s; max |CUDA - CPU| $(field "$RESULTS/merge.json" max_abs_diff), bit-identical $(field "$RESULTS/merge.json" bit_identical); $(field "$RESULTS/merge.json" elements_differing) elements differ, $(field "$RESULTS/merge.json" differing_at_the_cut) of them tied across the top-k cut, the farthest $(field "$RESULTS/merge.json" max_rank_distance_from_the_cut) ranks from it" $((SECONDS - t))
            else
                row "merge --cuda" fail "CUDA ${gpu_s}s, CPU ${cpu_s}s; comparing them failed: $(last_line "$RESULTS/merge.log")" $((SECONDS - t))
            fi
        else
            row "merge --cuda" fail "$(last_line "$RESULTS/merge.log")" $((SECONDS - t))
        fi
    fi
fi

# ------------------------------------------------------------------------------------------- table
row "checks (without set-up)" "-" "" $((SECONDS - T_CHECKS))
echo
column -t -s $'\t' "$ROWS" 2>/dev/null || cat "$ROWS"
echo "(logs and JSON: $RESULTS)"
! cut -f2 "$ROWS" | grep -qx fail
