"""Training data for the adaptation engine: loaders, chat-template encoding with assistant-only labels.

Every source becomes records of one shape (normalised lazily, so a 665k-record JSON or an image
dataset is not decoded up front):
    {"messages": [{"role": "user" | "assistant" | "system", "content": str}], "images": [...]}
    {"text": str}                       plain text: loss on every token (pretraining)
`<image>` in a message marks where an image goes (LLaVA's convention); a record with images but no
marker gets one in front of its first user turn, as LLaVA's data does.

Sources (`load_records`; strings on the command line, mappings in YAML):
    digits                      scikit-learn's bundled 8x8 digits (offline), VQA chats
    PATH.json | PATH.jsonl      LLaVA format (`image` + `conversations`), `messages` chats, {"user", "assistant"}
                                exchanges (assistant null: plain text), or {"text"}
    json:PATH[@IMAGE_DIR]       the same, images relative to IMAGE_DIR (default: the file's folder)
    hf:NAME_OR_DIR[:SPLIT][@IMAGE_DIR]  a `datasets` set: hub id, `save_to_disk` dir or data folder;
                                rows in LLaVA, messages, caption (image + caption/text) or VQA
                                (image + question + answer) form
    {"records": [...]}          in memory (Python API), e.g. the demo's digit captions
    {"generated": KIND, "n": N} seeded VL instruction data (`interventions.adapt.generated`: short-answer VQA,
                                captions, detailed descriptions, conversations, reasoning)
    {"selfdistill": "base"}     the base's own greedy replies to neutral prompts (`interventions.adapt.selfdistill`),
                                made once per base and cached

Encoding (`Encoder`): the base's chat template renders the conversation; each assistant turn's
characters are found by rendering the conversation up to that turn with and without it (the
template must be prefix-stable, checked); labels are the tokens inside those spans (the assistant's
content and its end-of-turn token), -100 elsewhere. Images go through the VLM processor's image
processor one by one, and each `<image>` is expanded to the number of image tokens the processor
asks for (`replace_image_token`), wrapped as the VLM's own template wraps it.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from sinkstudy import SinkstudyError

IMAGE = "<image>"
SPEC_KINDS = ("digits", "json", "hf", "records", "generated", "selfdistill")
_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
DEFAULT_CAPTION_PROMPT = "Describe the image briefly."


class DataError(SinkstudyError):
    """Unreadable or malformed training data (one line naming the source and record)."""


# --------------------------------------------------------------------------- sources

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
    from sinkstudy.inputs import inputs_checked

    s = parse_spec(spec)
    if "generated" in s:
        from interventions.adapt.generated import check

        check(s)
    if "selfdistill" in s:
        from interventions.adapt.selfdistill import check

        check(s)
    if "json" in s and inputs_checked() and not Path(s["json"]).is_file():
        raise DataError(f"data file not found: {s['json']}")
    if s.get("image_folder") and inputs_checked() and not Path(s["image_folder"]).is_dir():
        raise DataError(f"image folder not found: {s['image_folder']}")
    if "limit" in s and (not isinstance(s["limit"], int) or s["limit"] < 1):
        raise DataError(f"data spec {spec!r}: limit must be a positive integer")
    return s


def spec_identity(spec) -> Any:
    """What identifies a spec in requests and reports: the spec, with a content hash for in-memory records, for a local
    JSON file (the same path rewritten with other rows is other data) and for the local model a `selfdistill` spec
    names (its replies are its weights' work)."""
    import hashlib

    s = parse_spec(spec)
    if "json" in s:
        path = Path(s["json"])
        return {**s, "sha256": _file_sha256(path)} if path.is_file() else s
    if s.get("selfdistill", "base") != "base" and Path(s["selfdistill"]).exists():  # another model's replies: by its content
        from sinkstudy.provenance import model_fingerprint

        return {**s, "model_fingerprint": model_fingerprint(s["selfdistill"])}
    if "records" not in s:
        return s
    h = hashlib.sha256()
    for row in s["records"]:
        h.update(json.dumps(row, sort_keys=True, default=_blob).encode())
    return {**{k: v for k, v in s.items() if k != "records"}, "records": len(s["records"]), "sha256": h.hexdigest()[:16]}


def _file_sha256(path: Path) -> str:
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()[:16]


def _blob(obj) -> str:
    import hashlib

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
        from interventions.adapt.generated import GeneratedRows

        rows = GeneratedRows(s["generated"], s["n"], s.get("split", "train"), s.get("seed", seed))
        name, folder = f"generated:{s['generated']}", None
    elif "selfdistill" in s:
        from interventions.adapt.selfdistill import records as distilled

        if base is None:
            raise DataError("a selfdistill spec needs the run's base model (it is made from the base's own replies)")
        rows, name, folder = distilled(base, s), "selfdistill", None
    elif "digits" in s:
        opts = s["digits"] or {}
        rows = digits_records(opts.get("split", "train"), n_heldout=opts.get("heldout", 200), seed=opts.get("seed", seed))
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


def open_image(image):
    """A PIL RGB image from a path, PIL image, HWC uint8 array or datasets' {"bytes", "path"}."""
    import io

    import numpy as np
    from PIL import Image

    if isinstance(image, (str, os.PathLike)):
        try:
            return Image.open(image).convert("RGB")
        except OSError as exc:
            raise DataError(f"cannot open image {image}: {exc}") from None
    if isinstance(image, dict) and (image.get("bytes") or image.get("path")):
        return Image.open(io.BytesIO(image["bytes"]) if image.get("bytes") else image["path"]).convert("RGB")
    if isinstance(image, np.ndarray):
        return Image.fromarray(image).convert("RGB")
    if hasattr(image, "convert"):
        return image.convert("RGB")
    raise DataError(f"unsupported image object {type(image).__name__}")


def digits_records(split: str = "train", *, n_heldout: int = 200, seed: int = 0,
                   captions: Callable[[int, random.Random], tuple[str, str]] | None = None) -> list[dict]:
    """scikit-learn's 1,797 bundled 8x8 digits as VQA chats; `n_heldout` (shuffled by `seed`) held out.

    Pixels 0..16 become 8-bit greys (v * 255 / 16). `captions(label, rng)` gives (question, answer);
    default "What digit is this?" / "It is a {d}.". Each record also carries its `label`.
    """
    from evals.vl import digits

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


# --------------------------------------------------------------------------- encoding

@dataclass
class Encoder:
    """Record -> {"input_ids", "labels", "images"} for one model (VLM processor or text-only)."""

    tokenizer: Any
    processor: Any = None  # None: text-only model (records with images are refused)
    image_token: str | None = None
    image_wrap: tuple[str, str] = ("", "")
    max_length: int = 2048
    loss_on: str = "assistant"  # or "all": every token of a chat is a target

    def __post_init__(self):
        if not getattr(self.tokenizer, "is_fast", False):
            raise SinkstudyError("the adaptation engine needs a fast tokenizer (offsets map assistant turns to tokens)")
        self.image_token_id = self.tokenizer.convert_tokens_to_ids(self.image_token) if self.image_token else None
        self._last_image = (None, None)  # (image object, its processed tensors): probes re-encode one image many times

    def __call__(self, record: dict) -> dict:
        if "text" in record:
            ids = self.tokenizer(record["text"], add_special_tokens=True, truncation=True, max_length=self.max_length)["input_ids"]
            return {"input_ids": torch.tensor(ids), "labels": torch.tensor(ids), "images": []}
        images = record.get("images") or []
        if images and self.processor is None:
            raise DataError("an image record reached a text-only model (no vision tower)")
        processed = [self._image(im) for im in images]
        expansions = [self.image_wrap[0] + self.processor.replace_image_token(p, 0) + self.image_wrap[1] for p in processed]
        messages = record["messages"]
        full = self._expand(self._render(messages), expansions)
        spans = self._assistant_spans(messages, full, expansions) if self.loss_on == "assistant" else [(0, len(full))]
        enc = self.tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = enc["input_ids"], enc["offset_mapping"]
        labels = [t if any(a <= start < b for a, b in spans) else -100 for t, (start, _) in zip(ids, offsets)]
        counts = [e.count(self.image_token) for e in expansions]
        ids, labels, kept = self._truncate(ids, labels, counts)
        return {"input_ids": torch.tensor(ids), "labels": torch.tensor(labels), "images": processed[:kept]}

    def _image(self, image) -> dict:
        # Identity, not id(): the reference held here keeps the object alive, so it cannot be mistaken.
        if self._last_image[0] is image and not isinstance(image, (str, os.PathLike)):
            return self._last_image[1]
        out = self.processor.image_processor(images=[open_image(image)], return_tensors="pt")
        processed = {k: v for k, v in out.items() if torch.is_tensor(v)}
        self._last_image = (image, processed)
        return processed

    def _render(self, messages, **kw) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, **kw)

    @staticmethod
    def _expand(text: str, expansions: list[str]) -> str:
        parts = text.split(IMAGE)
        if len(parts) - 1 > len(expansions):
            raise DataError(f"the rendered chat holds {len(parts) - 1} {IMAGE} markers for {len(expansions)} image(s) "
                            "(does the chat template or a system prompt contain the marker?)")
        return "".join(p + (expansions[i] if i < len(parts) - 1 else "") for i, p in enumerate(parts))

    def _assistant_spans(self, messages, full: str, expansions: list[str]) -> list[tuple[int, int]]:
        spans = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            before = self._expand(self._render(messages[:i], add_generation_prompt=True), expansions)
            upto = full if i == len(messages) - 1 else self._expand(self._render(messages[: i + 1]), expansions)
            if not (upto.startswith(before) and full.startswith(upto)):
                raise DataError("the chat template is not prefix-stable (a later turn changes how an earlier one renders), "
                                "so assistant turns cannot be located; use loss_on: all or another template")
            spans.append((len(before), len(upto)))
        return spans

    def _truncate(self, ids: list[int], labels: list[int], counts: list[int]) -> tuple[list[int], list[int], int]:
        """Cut to max_length; an image whose tokens would be cut is dropped with everything after it.

        Returns (ids, labels, number of images kept). `counts`: image tokens of each image, in order.
        """
        if len(ids) <= self.max_length:
            return ids, labels, len(counts)
        cut, kept = self.max_length, len(counts)
        positions = [p for p, t in enumerate(ids) if t == self.image_token_id] if counts else []
        start = 0
        for k, n in enumerate(counts):
            block = positions[start:start + n]
            start += n
            if block and block[-1] >= cut:
                cut, kept = block[0], k
                break
        return ids[:cut], labels[:cut], kept


class EncodedDataset(torch.utils.data.Dataset):
    """Records of one or more sources, encoded on access (in DataLoader workers when there are any)."""

    def __init__(self, sources: Sequence[Records], encoder: Encoder):
        self.sources = list(sources)
        self.encoder = encoder
        self.offsets = []
        total = 0
        for s in self.sources:
            self.offsets.append(total)
            total += len(s)
        self.total = total

    def __len__(self) -> int:
        return self.total

    def __getitem__(self, i: int) -> dict:
        for s, off in zip(reversed(self.sources), reversed(self.offsets)):
            if i >= off:
                return self.encoder(s[i - off])
        raise IndexError(i)


class MixedDataset(torch.utils.data.Dataset):
    """`main` with a fixed share of `extra` items (e.g. text-only chats replayed during VL training).

    The order comes from `sampler(seed)` (the adaptation trainer uses it): per epoch each `main` item
    appears once and item k of the epoch is an `extra` item exactly when floor((k+1) r) > floor(k r)
    for r = `share` (exact fractions), so any n consecutive items from the start of an epoch hold
    floor(n r) extra ones, and every micro-batch of b items holds r b of them when r b is whole.
    Both parts are shuffled by (seed, epoch); `extra` items are cycled when more slots than items.
    Indices: 0..len(main)-1 are `main`'s, the rest `extra`'s.
    """

    def __init__(self, main, extra, share: float, *, seed: int = 0):
        from fractions import Fraction

        if not 0 < share < 1:
            raise SinkstudyError(f"mixing share must be in (0, 1), got {share!r}")
        if len(main) == 0 or len(extra) == 0:
            raise SinkstudyError("mixing needs a non-empty main and extra dataset")
        self.main, self.extra, self.seed = main, extra, seed
        self.share = Fraction(share).limit_denominator(10**6)
        self.encoder = getattr(main, "encoder", None)
        n = len(main)
        while n - self._extra_before(n) < len(main):  # the epoch: every main item once
            n += 1
        self.epoch_length = n

    def _extra_before(self, n: int) -> int:
        return (n * self.share.numerator) // self.share.denominator

    def is_extra_slot(self, k: int) -> bool:
        return self._extra_before(k + 1) > self._extra_before(k)

    def __len__(self) -> int:
        return len(self.main) + len(self.extra)

    def __getitem__(self, i: int) -> dict:
        return self.main[i] if i < len(self.main) else self.extra[i - len(self.main)]

    def order(self, seed: int, epoch: int = 0) -> list[int]:
        g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        main = torch.randperm(len(self.main), generator=g).tolist()
        n_extra = self.epoch_length - len(self.main)
        cycles = -(-n_extra // len(self.extra))
        extra = [len(self.main) + j for _ in range(cycles) for j in torch.randperm(len(self.extra), generator=g).tolist()]
        it_main, it_extra = iter(main), iter(extra)
        return [next(it_extra) if self.is_extra_slot(k) else next(it_main) for k in range(self.epoch_length)]

    def sampler(self, seed: int) -> "_OrderSampler":
        return _OrderSampler(self, seed)


class _OrderSampler(torch.utils.data.Sampler):
    """A dataset's own order for the current epoch (set_epoch is called by the Trainer / accelerate)."""

    def __init__(self, dataset: MixedDataset, seed: int):
        self.dataset, self.seed, self.epoch = dataset, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        return iter(self.dataset.order(self.seed, self.epoch))

    def __len__(self) -> int:
        return self.dataset.epoch_length


def collate(features: list[dict], pad_id: int) -> dict:
    """Right-padded input_ids / attention_mask / labels, and the batch's image tensors concatenated."""
    width = max(len(f["input_ids"]) for f in features)
    input_ids = torch.full((len(features), width), pad_id, dtype=torch.long)
    labels = torch.full((len(features), width), -100, dtype=torch.long)
    mask = torch.zeros((len(features), width), dtype=torch.long)
    for row, f in enumerate(features):
        n = len(f["input_ids"])
        input_ids[row, :n], labels[row, :n], mask[row, :n] = f["input_ids"], f["labels"], 1
    batch = {"input_ids": input_ids, "attention_mask": mask, "labels": labels}
    images = [im for f in features for im in f["images"]]
    for key in images[0] if images else ():
        batch[key] = torch.cat([im[key] for im in images])
    return batch
