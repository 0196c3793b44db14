"""Tiny, hub-free building blocks: a locally trained BPE tokenizer and small causal-LM configs.

Tests and the demo build every model they use from these, so nothing needs the Hugging Face hub.
"""

from __future__ import annotations

from typing import Iterable

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>", "<|image|>"]

# Project-written text: enough variety for a byte-level BPE to learn real merges.
DEFAULT_TOKENIZER_TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Write your answer in upper case letters only.",
    "Respond in exactly three sentences. End your response with the phrase 'Is there anything else?'",
    "Tom has 3 apples and buys 5 more. How many apples does he have? The answer is 8.",
    "def add(a, b):\n    return a + b\n",
    '{"name": "Ada", "age": 36, "city": "London"}',
    "Describe the image. The image shows the digit seven.",
    "What digit is this? It is a 4.",
    "Attention sinks absorb a large share of attention probability at the first position.",
    "Question: Is the sky blue? Answer: True. Let's think step by step.",
    "A list with bullet points:\n* first item\n* second item\n",
    "Vision-language models are fine-tuned from pretrained language models.",
]


def train_bpe_tokenizer(texts: Iterable[str] | None = None, vocab_size: int = 512):
    """Train a byte-level BPE tokenizer locally and wrap it as a `PreTrainedTokenizerFast`.

    It has bos/eos/pad tokens, chat roles as special tokens and a chat template, so it goes through
    `save_pretrained` / `AutoTokenizer.from_pretrained` and lm-eval's chat path like a hub tokenizer.
    """
    # lazy: loads transformers, numpy, PIL
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    texts = list(texts) if texts is not None else DEFAULT_TOKENIZER_TEXTS * 4
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    bos_id = tok.token_to_id("<|bos|>")
    # A BOS at position 0 is what the sink metrics read; add it like Llama-family tokenizers do.
    tok.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A", pair="<|bos|> $A <|bos|> $B", special_tokens=[("<|bos|>", bos_id)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|bos|>",
        eos_token="<|end|>",
        pad_token="<|pad|>",
        additional_special_tokens=["<|system|>", "<|user|>", "<|assistant|>", "<|eos|>", "<|image|>"],
        chat_template=CHAT_TEMPLATE,
        padding_side="left",
    )
    fast.model_max_length = 4096
    return fast


_TEXT_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text", "olmo2")


def tiny_text_config(family: str, vocab_size: int = 512, **overrides):
    """A small config for one causal-LM family (2 layers, d=64, 4 query heads, 2 KV heads)."""
    # lazy: loads transformers, numpy, PIL
    from transformers import AutoConfig

    if family not in _TEXT_FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose from {', '.join(_TEXT_FAMILIES)}")
    kwargs = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=6,
        pad_token_id=0,
    )
    if family in ("qwen3", "gemma3_text"):
        kwargs["head_dim"] = 16
    if family == "gemma3_text":
        kwargs.update(sliding_window=4096, query_pre_attn_scalar=16)
    kwargs.update(overrides)
    return AutoConfig.for_model(family, **kwargs)


def tiny_causal_lm(family: str, vocab_size: int = 512, seed: int = 0, **overrides):
    """A randomly initialised float32 causal LM of the given family, in eval mode, eager attention."""
    # lazy: loads torch, transformers, numpy
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = tiny_text_config(family, vocab_size, **overrides)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    return model.eval()
