"""The seed paper's six-pair study: the plan (offline, from the config alone) and the CUDA check.

Estimates come from the parameter counts stored in the config (`params_b`, billions, approximate
model-card figures), in bf16 (2 bytes per parameter):
- disk: every distinct hub model downloaded once (bases, VLMs, roots), plus per pair the extracted
  VLM language model and one checkpoint per intervention (each the size of the base LLM);
- GPU memory: the largest language model evaluated, weights plus `GPU_OVERHEAD` for activations
  and the KV cache of lm-eval's batched generation; the VLM itself is loaded on CPU for extraction,
  so host RAM needs the largest VLM.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Any

from experiments.study.methods import INJECTION, kind
from sinkstudy import SinkstudyError

BYTES_PER_PARAM = 2  # bf16 checkpoints and inference
GPU_OVERHEAD = 1.25  # activations + KV cache at lm-eval batch sizes (rough; IFEval generates up to 1280 tokens)


def plan(study) -> dict[str, Any]:
    """Everything the study would do, with size estimates; reads nothing but the config."""
    models: dict[str, float | None] = {}
    pairs = []
    disk_outputs, written, peak_extra = 0.0, 0, 0.0
    largest_lm = largest_vlm = 0.0

    for p in study.pairs:
        pb = p.params_b or {}
        for key, size in ((p.base, pb.get("base")), (p.vlm, pb.get("vlm")), (p.root, pb.get("base"))):
            if key:
                models[key] = size if size is not None else models.get(key)
        # extracted VLM LM + one checkpoint per intervention (QK-norm only where the base lacks it)
        outputs = 1 + sum(1 for i in study.interventions if kind(i.method) != INJECTION or not p.native_qk_norm)
        written += outputs
        base_b = pb.get("base")
        if base_b:  # without keep_models only the extracted LM stays, plus one intervention at a time
            disk_outputs += (outputs if study.keep_models else 1) * base_b * BYTES_PER_PARAM
            peak_extra = max(peak_extra, 0 if study.keep_models else base_b * BYTES_PER_PARAM)
            largest_lm = max(largest_lm, base_b)
        largest_vlm = max(largest_vlm, pb.get("vlm") or 0.0)
        pairs.append({"name": p.name, "base": p.base, "vlm": p.vlm, "root": p.root,
                      "native_qk_norm": p.native_qk_norm, "params_b": pb, "published": p.published or {}})
    disk_models = sum((v or 0.0) * BYTES_PER_PARAM for v in models.values())
    unknown = sorted(k for k, v in models.items() if v is None)
    return {
        "name": study.name,
        "protocol": study.protocol,
        "pairs": pairs,
        "tasks": {k: v for k, v in study.evals.protocol.as_dict().items() if k not in ("tasks", "data_files")}
                 | {"names": list(study.evals.protocol.tasks)},
        "sink": asdict(study.sink),
        "interventions": [asdict(i) for i in study.interventions],
        "model": asdict(study.model),
        "estimates": {
            "download_gb": disk_models,  # billions of parameters x bytes = GB
            "outputs_gb": disk_outputs,
            "disk_gb": disk_models + disk_outputs + peak_extra,
            "keep_models": study.keep_models,
            "gpu_gb": largest_lm * BYTES_PER_PARAM * GPU_OVERHEAD,
            "host_ram_gb": largest_vlm * BYTES_PER_PARAM,
            "distinct_models": len(models),
            "checkpoints_written": written,
            "models_without_size": unknown,
        },
        "out": str(study.out),
    }


def format_plan(pl: dict[str, Any]) -> str:
    e = pl["estimates"]
    t = pl["tasks"]
    lines = [f"sinkstudy paper plan: {pl['name']} (dry run: nothing downloaded, nothing run)", ""]
    if pl["protocol"]:
        lines.append("protocol: " + "; ".join(f"{k}: {v}" for k, v in pl["protocol"].items()))
        lines.append("")
    lines.append(f"{'pair':<30} {'base LLM':<30} {'VLM':<42} {'QK-norm':<8} {'params (B)':<12} paper S / IFEval delta")
    for p in pl["pairs"]:
        pb, pub = p["params_b"], p["published"]
        qk = {True: "native", False: "none"}.get(p["native_qk_norm"], "?")
        sizes = f"{pb.get('base', '?')}/{pb.get('vlm', '?')}"
        lines.append(f"{p['name']:<30} {p['base']:<30} {p['vlm']:<42} {qk:<8} {sizes:<12} "
                     f"{pub.get('sink_strength', 'n/a')} / {pub.get('ifeval_delta', 'n/a')}")
        if p["root"]:
            lines.append(f"{'':<30} root (task vectors): {p['root']}")
    lines += ["", f"tasks: {', '.join(t['names'])} (few-shot {t['num_fewshot'] if t['num_fewshot'] is not None else 'task default'}, "
                  f"chat template {'on' if t['apply_chat_template'] else 'off'}, limit {t['limit'] or 'none'}, "
                  f"max_gen_toks {t['max_gen_toks'] or 'task default'}, batch {t['batch_size']})",
              f"eval protocol: chat template kwargs {_kv(t['chat_template_kwargs'])}, system instruction "
              f"{json.dumps(t['system_instruction']) if t['system_instruction'] else 'none'}, generation kwargs {_kv(t['gen_kwargs'])}, "
              f"backend {t['backend']} (args {_kv(t['backend_args'])})",
              f"sink: metric {pl['sink']['metric']}, texts {pl['sink']['texts'] or 'the metric default'}",
              "interventions: " + ", ".join(f"{i['name']} ({i['method']} {', '.join(f'{k}={v}' for k, v in i['params'].items())})".replace(" )", ")")
                                           for i in pl["interventions"]),
              f"models: dtype {pl['model']['dtype']}, device {pl['model']['device'] or 'cpu'}", "",
              f"estimated disk: {e['disk_gb']:.0f} GB = {e['download_gb']:.0f} GB downloads ({e['distinct_models']} distinct models) "
              f"+ {e['disk_gb'] - e['download_gb']:.0f} GB written at peak ({e['checkpoints_written']} LM checkpoints: extracted VLM LMs and "
              f"intervention outputs{'' if e['keep_models'] else ', each intervention deleted once measured (keep_models: false)'})",
              f"estimated GPU memory: {e['gpu_gb']:.0f} GB (largest LM in bf16 x {GPU_OVERHEAD} for activations and KV cache); "
              f"host RAM for extraction: {e['host_ram_gb']:.0f} GB (largest VLM in bf16)"]
    if e["models_without_size"]:
        lines.append("no size in the config for: " + ", ".join(e["models_without_size"]) + " (not in the estimates)")
    lines.append(f"output: {pl['out']}")
    return "\n".join(lines)


def _kv(mapping: dict) -> str:
    return "{" + ", ".join(f"{k}: {json.dumps(v)}" for k, v in mapping.items()) + "}" if mapping else "none"


def check_can_run(study, limit) -> None:
    """Refuse a full run without CUDA; with --limit, run on CPU in the config's dtype."""
    # lazy: loads torch, numpy
    import torch

    if torch.cuda.is_available():
        return
    if limit is None:
        gb = plan(study)["estimates"]["gpu_gb"]
        raise SinkstudyError(f"the paper study needs a CUDA GPU (about {gb:.0f} GB for the largest model) and none is available; "
                             "`sinkstudy paper --dry-run` prints the plan, `--limit N` runs N prompts per task on CPU")
    if study.model.device not in (None, "cpu"):
        study.model.device = "cpu"
