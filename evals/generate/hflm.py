"""lm-eval's HF backend with sinkstudy's greedy generation loop: the `hf-continuous` eval backend.

`ContinuousHFLM` is lm-eval's `HFLM` in everything (chat template, loglikelihood, request
bookkeeping, tasks, filters, graders) except the generation loop of greedy `generate_until`
requests, which runs `evals.generate.loop.greedy_generate` over all of them at once (requests of
different tasks share the batch). The request semantics are HFLM's at its default batch size 1:
each context is encoded alone with HFLM's own `tok_batch_encode` (special tokens, left truncation
to max_length - max_gen_toks), a row stops where `model.generate` would stop it (an EOS id of the
model's generation config, lm-eval's own stop-sequence criteria on the `until` strings plus the
EOS text, or max_gen_toks) and its text is post-processed as HFLM does (think-end token, decoding
without special tokens, truncation at the first stop string). Requests that are not plain greedy
(sampling, extra generation kwargs, `max_length`) go through HFLM's own loop unchanged.
"""

from __future__ import annotations

import logging

import torch
from lm_eval.models.huggingface import HFLM
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from lm_eval.models.utils_hf import stop_sequences_criteria
from tqdm import tqdm
from transformers import GenerationConfig

from sinkstudy import SinkstudyError

from evals.generate.loop import Prompt, greedy_generate, unsupported_reason

log = logging.getLogger(__name__)

# Generation-config fields that make `model.generate` do more than argmax over the logits
# (logits processors, beam search, extra stopping rules): a model that sets any is refused.
_NOT_PLAIN_GREEDY = ("num_beams", "num_beam_groups", "penalty_alpha", "repetition_penalty", "encoder_repetition_penalty",
                     "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "bad_words_ids", "min_length", "min_new_tokens",
                     "forced_bos_token_id", "forced_eos_token_id", "suppress_tokens", "begin_suppress_tokens", "sequence_bias",
                     "exponential_decay_length_penalty", "diversity_penalty", "guidance_scale", "watermarking_config",
                     "stop_strings", "max_time", "num_return_sequences", "prompt_lookup_num_tokens", "dola_layers")


def not_plain_greedy(generation_config) -> list[str]:
    """The fields of a generation config that change greedy decoding, as "name=value"."""
    default = GenerationConfig()
    return [f"{k}={getattr(generation_config, k)!r}" for k in _NOT_PLAIN_GREEDY
            if getattr(generation_config, k, None) != getattr(default, k, None)]


class ContinuousHFLM(HFLM):
    """HFLM whose greedy generation runs continuously batched (`batch_size` rows at a time)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        name = type(self.model).__name__
        if self.backend != "causal":
            raise SinkstudyError(f"the hf-continuous backend generates with decoder-only models; {name} is {self.backend}: use --backend hf")
        if not isinstance(self.batch_size, int):
            raise SinkstudyError(f"the hf-continuous backend needs an integer batch size, got {self.batch_size!r}")
        reason = unsupported_reason(self.model)
        if reason:
            raise SinkstudyError(f"the hf-continuous backend cannot run this model: {reason}; use --backend hf")
        odd = not_plain_greedy(self.model.generation_config)
        if odd:
            raise SinkstudyError(f"{name}'s generation config sets {', '.join(odd)}, which plain greedy decoding does not apply; "
                                 "use --backend hf")

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        plans = [self._plan(req.args) for req in requests]
        fast = [i for i, p in enumerate(plans) if p is not None]
        other = [i for i, p in enumerate(plans) if p is None]
        results: list[str | None] = [None] * len(requests)
        if other:
            log.info("%d generate_until request(s) are not plain greedy: HFLM's own loop runs them", len(other))
            for i, text in zip(other, super().generate_until([requests[i] for i in other], disable_tqdm)):
                results[i] = text
        if fast:
            for i, text in zip(fast, self._generate_greedy([requests[i].args for i in fast], [plans[i] for i in fast], disable_tqdm)):
                results[i] = text
        return results

    def _plan(self, args) -> tuple[list[str], int] | None:
        return greedy_plan(args[1], self.max_gen_toks, self.tok_decode(self.eot_token_id, skip_special_tokens=False))

    def _generate_greedy(self, args: list[tuple], plans: list[tuple[list[str], int]], disable_tqdm: bool) -> list[str]:
        prompts = []
        for (context, _), (until, max_gen_toks) in zip(args, plans):
            max_ctx_len = self.max_length - max_gen_toks
            if max_ctx_len <= 0:
                raise SinkstudyError(f"max_gen_toks {max_gen_toks} leaves no room for the prompt within the model's max length {self.max_length}")
            ids, _ = self.tok_batch_encode([context], left_truncate_len=max_ctx_len, truncation=self.truncation)
            prompts.append(Prompt(ids[0].tolist(), max_gen_toks, stop_test(self.tokenizer, until)))
        # The largest token budget first (a long answer started late would end the run alone), then the
        # longest prompt, as HFLM orders its batches. The order changes only which rows share a step.
        order = sorted(range(len(prompts)), key=lambda i: (-prompts[i].max_new_tokens, -len(prompts[i].ids), args[i][0]))
        pbar = tqdm(total=len(prompts), disable=disable_tqdm or self.rank != 0, desc="Running generate_until requests (continuous batching)")
        eos = self.model.generation_config.eos_token_id
        with torch.autocast(device_type=self.device.type, dtype=self.mixed_precision_dtype, enabled=self.mixed_precision_dtype is not None):
            generated = greedy_generate(self.model, [prompts[i] for i in order], batch_size=self.batch_size,
                                        eos_token_ids=[] if eos is None else [eos] if isinstance(eos, int) else list(eos),
                                        on_done=lambda _: pbar.update(1))
        pbar.close()
        texts: list[str] = [""] * len(prompts)
        for i, toks in zip(order, generated):
            context, gen_kwargs = args[i]
            texts[i] = self._postprocess(toks, plans[i][0])
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), texts[i])
        return texts

    def _postprocess(self, cont_toks: list[int], until: list[str]) -> str:
        """HFLM.generate_until's text from a row's generated tokens."""
        if isinstance(self.think_end_token, int):
            marks = [i for i, t in enumerate(cont_toks) if t == self.think_end_token]
            if marks:
                cont_toks = cont_toks[marks[-1] + 1:]
        s = self.tok_decode(cont_toks)
        if isinstance(self.think_end_token, int):
            s = s.lstrip()
        return postprocess_generated_text(generation=s, stop=until,
                                          think_end_token=self.think_end_token if isinstance(self.think_end_token, str) else None)


def greedy_plan(gen_kwargs: dict, default_max_gen_toks: int, eos_text: str) -> tuple[list[str], int] | None:
    """(until strings with the EOS text appended, max_gen_toks) of a plain greedy request, as HFLM
    normalises them; None when the request samples or sets anything else."""
    kwargs = normalize_gen_kwargs(gen_kwargs, default_max_gen_toks)
    until = handle_stop_sequences(kwargs.pop("until", None), eos=eos_text)
    max_gen_toks = kwargs.pop("max_gen_toks")
    kwargs.pop("temperature", None)
    if kwargs.pop("do_sample") or kwargs or max_gen_toks < 1:
        return None
    return until, max_gen_toks


def stop_test(tokenizer, until: list[str]):
    """lm-eval's own stop-sequence criteria, as `model.generate` applies them to a batch-1 row."""
    criteria = stop_sequences_criteria(tokenizer, until, 0, 1)
    lookback = max((c.sequence_id_len for c in criteria), default=0)

    def stop(generated: list[int]) -> bool:
        return bool(criteria(torch.tensor([generated[-lookback:]]), None).any()) if criteria else False

    return stop
