"""Fast greedy generation for the lm-eval bridge: continuous batching over a packed KV cache.

    from evals.generate import ContinuousHFLM, greedy_generate, Prompt

Files from the bottom: `packed` (the cache) < `loop` (`greedy_generate`) < `hflm` (lm-eval's HFLM
with that loop: the `hf-continuous` backend of `evals.lmeval.run_eval`); `bench` measures it.
"""

from evals.generate.loop import Prompt, greedy_generate, unsupported_reason

__all__ = ["Prompt", "greedy_generate", "unsupported_reason"]
