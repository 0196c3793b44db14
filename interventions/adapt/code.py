"""The modules each kind of the adaptation engine's work runs, by name: part of the key of every result it makes
(`sinkstudy.provenance.module_code_version`). A figure (`trajectory_plot`), the probes and the estimates are no part
of them: editing one makes nothing again."""

from evals.sink import MEASURE_CODE

VL_WORLD = ("evals.vl.digits", "evals.vl.easyvqa", "evals.vl.scenes", "evals.vl.questions")
# One stage of training on the engine's `Trainer` (pretraining, recovery training, every adaptation stage).
TRAINING = ("interventions.adapt.config", "interventions.adapt.sources", "interventions.adapt.encoding", "interventions.adapt.trainer",
            "interventions.adapt.hooks", "interventions.adapt.vlm_io", "interventions.training")
# The Sink Strength measured during training (a run's trajectory).
SINK_PROBE = ("interventions.adapt.trajectory", *MEASURE_CODE)
# A whole run (`interventions.adapt.run.adapt`): build, data of every kind, stages, the probe, shared stages, save.
RUN = (*TRAINING, *SINK_PROBE, *VL_WORLD, "interventions.adapt.run", "interventions.adapt.build", "interventions.adapt.generated",
       "interventions.adapt.selfdistill", "interventions.adapt.tower", "interventions.adapt.stagecache", "interventions.qknorm",
       "interventions.qknorm_modes", "evals.generate.packed", "evals.generate.loop")
