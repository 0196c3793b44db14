"""VL adaptation as a first-class stage: LLaVA-style two-stage training of any base LLM on HF Trainer.

    from interventions.adapt import VisionSpec, adapt, paper_recipe

    cfg = paper_recipe()
    cfg.stage("stage1").data = ["json:blip_laion_cc_sbu_558k.json@images/"]
    cfg.stage("stage2").data = ["json:llava_v1_5_mix665k.json@images/"]
    report = adapt("Qwen/Qwen2.5-3B-Instruct", vision=VisionSpec("donor", "Qwen/Qwen2.5-VL-3B-Instruct"),
                   config=cfg, out="runs/adapt/qwen2.5-3b", resume=True)

Modules: `config` (recipes, the paper's defaults), `build` (fresh / donor / tiny VLM around a base,
round trip, save/load), `vlm_io` (a VLM's language model taken out and put back), `sources` (data specs and
their records), `encoding` (chat-template encoding with assistant-only labels, datasets, batches), `trainer`
(one stage on `Trainer`), `hooks` (the protection seam), `trajectory` (Sink Strength during training),
`run` (a whole resumable run), `estimate` (GPU memory and time). See docs/adapt.md.

The names load with the module that defines them, on first use: the light modules (`config`, `sources`) are
read without loading torch.
"""

from importlib import import_module

_WHERE = {
    "interventions.adapt.build": ("build_vlm", "check_round_trip"),
    "interventions.adapt.vlm_io": ("causal_view", "extract_lm", "language_model", "load_vlm", "save_vlm"),
    "interventions.adapt.config": ("AdaptConfig", "AdaptConfigError", "StageConfig", "TrajectoryConfig", "VisionSpec", "from_dict",
                                   "load_config", "paper_recipe", "text_recipe"),
    "interventions.adapt.hooks": ("FreezeParameters", "HookContext", "TrainingHook"),
    "interventions.adapt.run": ("adapt",),
    "interventions.adapt.trainer": ("train_stage",),
}
_MODULE = {name: module for module, names in _WHERE.items() for name in names}
__all__ = list(_MODULE)


def __getattr__(name: str):
    if name not in _MODULE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(_MODULE[name]), name)
