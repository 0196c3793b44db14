"""VL adaptation as a first-class stage: LLaVA-style two-stage training of any base LLM on HF Trainer.

    from interventions.adapt import VisionSpec, adapt, paper_recipe

    cfg = paper_recipe()
    cfg.stage("stage1").data = ["json:blip_laion_cc_sbu_558k.json@images/"]
    cfg.stage("stage2").data = ["json:llava_v1_5_mix665k.json@images/"]
    report = adapt("Qwen/Qwen2.5-3B-Instruct", vision=VisionSpec("donor", "Qwen/Qwen2.5-VL-3B-Instruct"),
                   config=cfg, out="runs/adapt/qwen2.5-3b", resume=True)

Modules: `config` (recipes, the paper's defaults), `build` (fresh / donor / tiny VLM around a base,
round trip, save/load, live views), `data` (sources, chat-template encoding with assistant-only
labels), `trainer` (one stage on `Trainer`), `hooks` (the protection seam), `trajectory` (Sink
Strength during training), `run` (a whole resumable run), `estimate` (GPU memory and time).
See docs/adapt.md.
"""

from interventions.adapt.build import VisionSpec, build_vlm, causal_view, check_round_trip, extract_lm, language_model, load_vlm, save_vlm
from interventions.adapt.config import AdaptConfig, AdaptConfigError, StageConfig, TrajectoryConfig, from_dict, load_config, paper_recipe, text_recipe
from interventions.adapt.hooks import FreezeParameters, HookContext, TrainingHook
from interventions.adapt.run import adapt
from interventions.adapt.trainer import train_stage

__all__ = [
    "AdaptConfig", "AdaptConfigError", "FreezeParameters", "HookContext", "StageConfig", "TrainingHook", "TrajectoryConfig",
    "VisionSpec", "adapt", "build_vlm", "causal_view", "check_round_trip", "extract_lm", "from_dict", "language_model",
    "load_config", "load_vlm", "paper_recipe", "save_vlm", "text_recipe", "train_stage",
]
