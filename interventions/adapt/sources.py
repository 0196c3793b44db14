"""Training data for the adaptation engine, as records: the data specs and the sources they name.

Every source becomes records of one shape (normalised lazily, so a 665k-record JSON or an image
dataset is not decoded up front):
    {"messages": [{"role": "user" | "assistant" | "system", "content": str}], "images": [...]}
    {"text": str}                       plain text: loss on every token (pretraining)
`<image>` in a message marks where an image goes (LLaVA's convention); a record with images but no
marker gets one in front of its first user turn, as LLaVA's data does.

Sources (`load_records`; strings on the command line, mappings in YAML):
    digits                      scikit-learn's bundled 8x8 digits (offline), VQA chats; {"digits": {"captions":
                                "varied"}} asks and answers in three styles (`varied_digit_caption`)
    PATH.json | PATH.jsonl      LLaVA format (`image` + `conversations`), `messages` chats, {"user", "assistant"}
                                exchanges (assistant null: plain text), or {"text"}
    json:PATH[@IMAGE_DIR]       the same, images relative to IMAGE_DIR (default: the file's folder)
    hf:NAME_OR_DIR[:SPLIT][@IMAGE_DIR]  a `datasets` set: hub id, `save_to_disk` dir or data folder;
                                rows in LLaVA, messages, caption (image + caption/text) or VQA
                                (image + question + answer) form
    {"records": [...]}          in memory (Python API)
    {"generated": KIND, "n": N} seeded VL instruction data (`interventions.adapt.generated`: short-answer VQA,
                                captions, detailed descriptions, conversations, reasoning)
    {"selfdistill": "base"}     the base's own greedy replies to neutral prompts (`interventions.adapt.selfdistill`),
                                made once per base and cached
The records become model inputs in `interventions.adapt.encoding`.
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path
from typing import Any, Callable, Sequence

from evals.vl import digits
from interventions.adapt import generated, selfdistill
from sinkstudy import SinkstudyError
from sinkstudy.inputs import inputs_checked
from sinkstudy.provenance import file_sha256, model_fingerprint

IMAGE = "<image>"
SPEC_KINDS = ("digits", "json", "hf", "records", "generated", "selfdistill")
_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
DEFAULT_CAPTION_PROMPT = "Describe the image briefly."
_DIGIT_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")


class DataError(SinkstudyError):
    """Unreadable or malformed training data (one line naming the source and record)."""


def parse_spec(spec) -> dict:
    """A data spec (string or mapping) as a mapping with one of the keys digits / json / hf / records."""
    if isinstance(spec, dict):
        kinds = [k for k in SPEC_KINDS if k in spec]
        if len(kinds) != 1:
            raise DataError(f"data spec {spec!r}: give exactly one of {', '.join(SPEC_KINDS)}")
        unknown = set(spec) - set(SPEC_KINDS) - {"image_folder", "split", "limit", "caption_prompt", "n", "seed",
                                                  "prompts", "max_new_tokens"}
        if unknown:
            raise DataError(f"data spec: unknown key(s) {', '.join(sorted(unknown))}")
        return dict(spec)
    if not isinstance(spec, str) or not spec:
        raise DataError(f"data spec must be a string or mapping, got {spec!r}")
    if spec == "digits":
        return {"digits": {}}
    if spec.startswith("hf:"):
        body, _, folder = spec[3:].partition("@")
        name, _, split = body.rpartition(":") if ":" in body else (body, "", "")
        return {"hf": name or body, "split": split or "train", **({"image_folder": folder} if folder else {})}
    body = spec[5:] if spec.startswith("json:") else spec
    path, _, folder = body.partition("@")
    if spec.startswith("json:") or path.endswith((".json", ".jsonl")):
        return {"json": path, **({"image_folder": folder} if folder else {})}
    raise DataError(f"unknown data spec {spec!r}: use digits, PATH.json[l], json:PATH[@IMAGES] or hf:NAME[:SPLIT][@IMAGES]")


def check_spec(spec) -> dict:
    """Parse and check a spec without reading it all (missing files fail here, before any work; not while a study
    is only planned: `sinkstudy.inputs`)."""
    s = parse_spec(spec)
    if "generated" in s:
        generated.check(s)
    if "selfdistill" in s:
        selfdistill.check(s)
    if "json" in s and inputs_checked() and not Path(s["json"]).is_file():
        raise DataError(f"data file not found: {s['json']}")
    if s.get("image_folder") and inputs_checked() and not Path(s["image_folder"]).is_dir():
        raise DataError(f"image folder not found: {s['image_folder']}")
    if "digits" in s and (s["digits"] or {}).get("captions", "plain") not in DIGIT_CAPTIONS:
        raise DataError(f"data spec {spec!r}: digits captions must be one of {', '.join(DIGIT_CAPTIONS)}")
    if "limit" in s and (not isinstance(s["limit"], int) or s["limit"] < 1):
        raise DataError(f"data spec {spec!r}: limit must be a positive integer")
    return s


def spec_identity(spec) -> Any:
    """What identifies a spec in requests and reports: the spec, with a content hash for in-memory records, for a local
    JSON file (the same path rewritten with other rows is other data) and for the local model a `selfdistill` spec
    names (its replies are its weights' work)."""
    s = parse_spec(spec)
    if "json" in s:
        path = Path(s["json"])
        return {**s, "sha256": file_sha256(path)[:16]} if path.is_file() else s
    if s.get("selfdistill", "base") != "base" and Path(s["selfdistill"]).exists():  # another model's replies: by its content
        return {**s, "model_fingerprint": model_fingerprint(s["selfdistill"])}
    if "records" not in s:
        return s
    h = hashlib.sha256()
    for row in s["records"]:
        h.update(json.dumps(row, sort_keys=True, default=_blob).encode())
    return {**{k: v for k, v in s.items() if k != "records"}, "records": len(s["records"]), "sha256": h.hexdigest()[:16]}


def _blob(obj) -> str:
    # lazy: loads numpy
    import numpy as np

    if isinstance(obj, np.ndarray):
        return hashlib.sha256(obj.tobytes() + str(obj.shape).encode()).hexdigest()
    if hasattr(obj, "tobytes"):  # PIL image
        return hashlib.sha256(obj.tobytes()).hexdigest()
    return str(obj)


def load_records(spec, *, seed: int = 0, base=None) -> "Records":
    """The records of one source, normalised on access. `base` (a path, name or loaded causal LM): the run's
    base, which a `selfdistill` spec's replies come from."""
    s = check_spec(spec)
    prompt = s.get("caption_prompt", DEFAULT_CAPTION_PROMPT)
    if "generated" in s:
        rows = generated.GeneratedRows(s["generated"], s["n"], s.get("split", "train"), s.get("seed", seed))
        name, folder = f"generated:{s['generated']}", None
    elif "selfdistill" in s:
        if base is None:
            raise DataError("a selfdistill spec needs the run's base model (it is made from the base's own replies)")
        rows, name, folder = selfdistill.records(base, s), "selfdistill", None
    elif "digits" in s:
        opts = s["digits"] or {}
        rows = digits_records(opts.get("split", "train"), n_heldout=opts.get("heldout", 200), seed=opts.get("seed", seed),
                              captions=DIGIT_CAPTIONS[opts.get("captions", "plain")])
        name, folder = "digits", None
    elif "records" in s:
        rows, name, folder = list(s["records"]), "records", None
    elif "json" in s:
        rows, name = _read_json(Path(s["json"])), s["json"]
        folder = Path(s.get("image_folder") or Path(s["json"]).parent)
    else:
        rows, name = _read_dataset(s["hf"], s.get("split", "train")), f"hf:{s['hf']}"
        folder = Path(s["image_folder"]) if s.get("image_folder") else None
    records = Records(rows, name, folder, prompt)
    if s.get("limit"):
        records = records.subset(range(min(s["limit"], len(records))))
    if isinstance(rows, list) and "json" in s:
        records.validate()  # cheap for in-memory JSON: placeholder counts vs images, roles
    return records


class Records(Sequence):
    """A lazily normalised view of raw rows (a list or a `datasets.Dataset`)."""

    def __init__(self, rows, name: str, image_folder: Path | None, caption_prompt: str, index: Sequence[int] | None = None):
        self.rows, self.name, self.image_folder, self.caption_prompt = rows, name, image_folder, caption_prompt
        self.index = index

    def __len__(self) -> int:
        return len(self.index) if self.index is not None else len(self.rows)

    def __getitem__(self, i: int) -> dict:
        j = self.index[i] if self.index is not None else i
        try:
            return normalise(self.rows[j], self.image_folder, self.caption_prompt)
        except DataError as exc:
            raise DataError(f"{self.name} record {j}: {exc}") from None

    def subset(self, index) -> "Records":
        base = list(index) if self.index is None else [self.index[i] for i in index]
        return Records(self.rows, self.name, self.image_folder, self.caption_prompt, base)

    def validate(self) -> None:
        for i in range(len(self)):
            self[i]


def _read_json(path: Path) -> list:
    try:
        text = path.read_text(encoding="utf-8")
        rows = [json.loads(line) for line in text.splitlines() if line.strip()] if path.suffix == ".jsonl" else json.loads(text)
    except (OSError, ValueError) as exc:
        raise DataError(f"cannot read {path}: {exc}") from None
    if isinstance(rows, dict):
        rows = rows.get("data") or rows.get("records")
    if not isinstance(rows, list) or not rows:
        raise DataError(f"{path}: expected a non-empty list of records")
    return rows


def _read_dataset(name: str, split: str):
    # lazy: loads datasets, numpy, huggingface_hub
    import datasets

    try:
        if Path(name).is_dir() and any((Path(name) / f).is_file() for f in ("dataset_info.json", "state.json", "dataset_dict.json")):
            ds = datasets.load_from_disk(name)
            ds = ds[split] if isinstance(ds, datasets.DatasetDict) else ds
        else:
            ds = datasets.load_dataset(name, split=split)
    except (OSError, ValueError, KeyError, FileNotFoundError, ConnectionError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DataError(f"cannot load dataset {name!r} (split {split!r}): {first}") from None
    if len(ds) == 0:
        raise DataError(f"dataset {name!r} split {split!r} is empty")
    return ds


def normalise(row: dict, image_folder: Path | None = None, caption_prompt: str = DEFAULT_CAPTION_PROMPT) -> dict:
    """One raw row in any supported form -> {"messages", "images"} or {"text"}."""
    if not isinstance(row, dict):
        raise DataError(f"a record must be a mapping, got {type(row).__name__}")
    images = row.get("images", row.get("image"))
    images = [] if images is None else list(images) if isinstance(images, (list, tuple)) else [images]
    images = [_resolve_image(im, image_folder) for im in images]
    if "conversations" in row:
        messages = [{"role": _role(t.get("from", t.get("role"))), "content": _text(t.get("value", t.get("content")))}
                    for t in row["conversations"]]
    elif "messages" in row:
        messages = [{"role": _role(m.get("role")), "content": _text(m.get("content"))} for m in row["messages"]]
    elif images and ("caption" in row or "text" in row):
        messages = [{"role": "user", "content": f"{IMAGE}\n{caption_prompt}"},
                    {"role": "assistant", "content": str(row.get("caption", row.get("text")))}]
    elif images and "question" in row and "answer" in row:
        messages = [{"role": "user", "content": f"{IMAGE}\n{row['question']}"}, {"role": "assistant", "content": str(row["answer"])}]
    elif isinstance(row.get("user"), str) and "assistant" in row:  # a single exchange; no reply: plain text
        if row["assistant"] is None:
            return {"text": row["user"]}
        messages = [{"role": "user", "content": row["user"]}, {"role": "assistant", "content": _text(row["assistant"])}]
    elif isinstance(row.get("text"), str):
        return {"text": row["text"]}
    else:
        raise DataError(f"unrecognised record with keys {sorted(row)[:8]}: expected conversations, messages, "
                        "image + caption/text, image + question + answer, user + assistant, or text")
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError("a chat record needs at least one assistant turn")
    markers = sum(m["content"].count(IMAGE) for m in messages)
    if images and markers == 0:
        first = next(i for i, m in enumerate(messages) if m["role"] == "user")
        messages[first] = {**messages[first], "content": f"{IMAGE}\n{messages[first]['content']}"}
        markers = 1 if len(images) == 1 else markers
    if markers != len(images):
        raise DataError(f"{markers} {IMAGE} marker(s) for {len(images)} image(s)")
    if any(m["role"] == "assistant" and IMAGE in m["content"] for m in messages):
        raise DataError(f"an assistant turn contains {IMAGE}")
    return {"messages": messages, "images": images}


def _role(role) -> str:
    if role not in _ROLES:
        raise DataError(f"unknown role {role!r}; expected one of {', '.join(_ROLES)}")
    return _ROLES[role]


def _text(content) -> str:
    """Message content as text: a string, or HF-style parts ({"type": "image"} -> <image>)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for p in content:
            kind = p.get("type") if isinstance(p, dict) else None
            parts.append(IMAGE if kind == "image" else p.get("text", "") if kind == "text" else None)
            if parts[-1] is None:
                raise DataError(f"unknown message part {p!r}")
        return "".join(parts)
    raise DataError(f"message content must be text or a list of parts, got {type(content).__name__}")


def _resolve_image(image, folder: Path | None):
    if isinstance(image, str):
        path = Path(image) if Path(image).is_absolute() or folder is None else folder / image
        return path
    return image  # PIL image, array, or datasets' {"bytes", "path"} dict: opened at encode time


def varied_digit_caption(label: int, rng: random.Random) -> tuple[str, str]:
    """A (question, answer) pair about an image of a digit in one of three styles, LLaVA-style VQA or captioning."""
    word = _DIGIT_WORDS[label]
    style = rng.randrange(3)
    if style == 0:
        return "What digit is this?", f"It is a {label}."
    if style == 1:
        return "Describe the image.", f"The image shows the digit {word}, written in white on a black background."
    return "Which number is shown in the picture?", f"The picture shows the number {label}, which is {word}."


# How a `digits` spec asks about its images: "plain" always "What digit is this?" / "It is a d."
DIGIT_CAPTIONS: dict[str, Callable[[int, random.Random], tuple[str, str]] | None] = {"plain": None, "varied": varied_digit_caption}


def digits_records(split: str = "train", *, n_heldout: int = 200, seed: int = 0,
                   captions: Callable[[int, random.Random], tuple[str, str]] | None = None) -> list[dict]:
    """scikit-learn's 1,797 bundled 8x8 digits as VQA chats; `n_heldout` (shuffled by `seed`) held out.

    Pixels 0..16 become 8-bit greys (v * 255 / 16). `captions(label, rng)` gives (question, answer);
    default "What digit is this?" / "It is a {d}.". Each record also carries its `label`.
    """
    if split not in digits.SPLITS:
        raise DataError(f"digits split must be train or heldout, got {split!r}")
    rng = random.Random(seed)
    out = []
    for i in digits.split_indices(split, n_heldout=n_heldout, seed=seed):
        label = digits.label(i)
        question, answer = captions(label, rng) if captions else ("What digit is this?", f"It is a {label}.")
        out.append({"images": [digits.rgb(i)],
                    "messages": [{"role": "user", "content": f"{IMAGE}\n{question}"}, {"role": "assistant", "content": answer}],
                    "label": label})
    return out
