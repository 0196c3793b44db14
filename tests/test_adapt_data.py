"""Training data for the adaptation engine: LLaVA-format JSON, `datasets` image-text sets (saved and
plain data folders), text-only chats and the digits each load; labels cover exactly the assistant
turns; images expand to the tokens the model expects, also in mixed image + text batches."""

import json

import numpy as np
import pytest
import torch

from interventions.adapt import encoding, sources
from interventions.adapt.build import build_vlm
from interventions.adapt.config import VisionSpec
from sinkstudy.tiny import tiny_causal_lm

TINY = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "patch_size": 4}


@pytest.fixture(scope="module")
def built(tokenizer):
    return build_vlm(tiny_causal_lm("qwen2", vocab_size=len(tokenizer)), tokenizer, VisionSpec("tiny", tiny=TINY))


def _encoder(built, **kw):
    return encoding.Encoder(built.tokenizer, processor=built.processor, image_token=built.image_token, **kw)


def _png(path, value: int):
    from PIL import Image

    Image.fromarray(np.full((8, 8, 3), value, np.uint8)).save(path)
    return path.name


def _llava_json(tmp_path):
    (tmp_path / "img").mkdir()
    rows = [
        {"id": "a", "image": _png(tmp_path / "img" / "a.png", 10),
         "conversations": [{"from": "human", "value": "<image>\nWhat is shown?"}, {"from": "gpt", "value": "A dark square."},
                           {"from": "human", "value": "Is it bright?"}, {"from": "gpt", "value": "No."}]},
        {"id": "b", "image": _png(tmp_path / "img" / "b.png", 250),
         "conversations": [{"from": "human", "value": "Describe it."}, {"from": "gpt", "value": "A bright square."}]},
        {"id": "c", "conversations": [{"from": "human", "value": "Say hello."}, {"from": "gpt", "value": "Hello."}]},
    ]
    path = tmp_path / "llava.json"
    path.write_text(json.dumps(rows))
    return path


def _label_text(tok, enc) -> str:
    return tok.decode([t for t in enc["labels"].tolist() if t != -100])


def test_llava_json_loads_with_images_text_only_records_and_assistant_labels(tmp_path, built):
    records = sources.load_records(f"json:{_llava_json(tmp_path)}@{tmp_path / 'img'}")
    assert len(records) == 3 and not records[2]["images"]
    assert records[1]["messages"][0]["content"].startswith(sources.IMAGE)  # marker added, as LLaVA's data does
    enc = _encoder(built)
    tok = built.tokenizer
    first = enc(records[0])
    assert _label_text(tok, first) == "A dark square.<|end|>\nNo.<|end|>\n"
    assert int((first["input_ids"] == tok.convert_tokens_to_ids(built.image_token)).sum()) == 4
    assert len(first["images"]) == 1 and first["images"][0]["pixel_values"].shape == (1, 3, 8, 8)
    # Same JSON, default image folder = the file's folder + "img/..." paths
    rows = json.loads((tmp_path / "llava.json").read_text())
    for r in rows:
        if "image" in r:
            r["image"] = f"img/{r['image']}"
    (tmp_path / "rel.json").write_text(json.dumps(rows))
    assert len(sources.load_records(str(tmp_path / "rel.json"))[0]["images"]) == 1


def test_labels_ignore_what_the_user_says(built):
    """Changing every non-assistant token (system prompt, user text) leaves the label sequence unchanged."""
    enc = _encoder(built)
    img = [np.zeros((8, 8, 3), np.uint8)]
    a = enc({"images": img, "messages": [{"role": "user", "content": "<image>\nWhat digit is this?"},
                                         {"role": "assistant", "content": "It is a 7."}]})
    b = enc({"images": img, "messages": [{"role": "system", "content": "Be brief and exact."},
                                         {"role": "user", "content": "<image>\nName the number in the picture, please."},
                                         {"role": "assistant", "content": "It is a 7."}]})
    assert len(a["input_ids"]) != len(b["input_ids"])
    la, lb = (x["labels"][x["labels"] != -100] for x in (a, b))
    assert torch.equal(la, lb) and _label_text(built.tokenizer, a) == "It is a 7.<|end|>\n"
    everything = _encoder(built, loss_on="all")({"images": img, "messages": [
        {"role": "user", "content": "<image>\nWhat digit is this?"}, {"role": "assistant", "content": "It is a 7."}]})
    assert int((everything["labels"] != -100).sum()) == len(everything["input_ids"])


def test_text_only_chat_set_and_plain_text(tmp_path, tokenizer):
    path = tmp_path / "tulu.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [
        {"messages": [{"role": "user", "content": "Add 2 and 3."}, {"role": "assistant", "content": "5"}]},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}, {"role": "assistant", "content": "Hello!"}]},
        {"text": "Plain pretraining text."},
    ]))
    records = sources.load_records(str(path))
    enc = encoding.Encoder(tokenizer)  # a text-only model: no processor
    assert _label_text(tokenizer, enc(records[0])) == "5<|end|>\n"
    plain = enc(records[2])
    assert torch.equal(plain["labels"], plain["input_ids"]) and plain["input_ids"][0] == tokenizer.bos_token_id
    with pytest.raises(sources.DataError, match="text-only model"):
        enc({"images": [np.zeros((8, 8, 3), np.uint8)], "messages": [{"role": "user", "content": "<image>"},
                                                                      {"role": "assistant", "content": "x"}]})


def test_datasets_image_text_sets_load_from_disk_and_from_a_data_folder(tmp_path, built):
    import datasets
    from PIL import Image

    images = [Image.fromarray(np.full((8, 8, 3), v, np.uint8)) for v in (0, 128, 255)]
    ds = datasets.Dataset.from_dict({"image": images, "caption": ["black", "grey", "white"]},
                                    features=datasets.Features({"image": datasets.Image(), "caption": datasets.Value("string")}))
    ds.save_to_disk(tmp_path / "saved")
    records = sources.load_records(f"hf:{tmp_path / 'saved'}")
    assert len(records) == 3 and records[2]["messages"][1]["content"] == "white"
    assert len(_encoder(built)(records[1])["images"]) == 1
    # A plain folder of files goes through datasets' own builders (json here); VQA rows, images by path.
    (tmp_path / "folder").mkdir()
    _png(tmp_path / "folder" / "x.png", 7)
    (tmp_path / "folder" / "train.jsonl").write_text(json.dumps({"image": "x.png", "question": "Dark?", "answer": "Yes."}) + "\n")
    rec = sources.load_records(f"hf:{tmp_path / 'folder'}:train@{tmp_path / 'folder'}")[0]
    assert _label_text(built.tokenizer, _encoder(built)(rec)) == "Yes.<|end|>\n"


def test_digits_split(built):
    train, held = sources.load_records("digits"), sources.digits_records("heldout", n_heldout=200)
    assert len(train) == 1797 - 200 and len(held) == 200
    assert train[0]["messages"][1]["content"].startswith("It is a ")
    px = _encoder(built)(train[0])["images"][0]["pixel_values"]
    assert px.min() >= -1 and px.max() <= 1 and px.std() > 0.1


def test_mixed_batch_of_image_and_text_records_trains(built):
    from interventions.adapt.trainer import label_only_loss

    enc = _encoder(built)
    feats = [enc(sources.digits_records("heldout", n_heldout=2)[0]),
             enc({"messages": [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi."}]})]
    batch = encoding.collate(feats, built.tokenizer.pad_token_id)
    assert batch["pixel_values"].shape[0] == 1
    labels = batch.pop("labels")
    loss, _ = label_only_loss(built.model, batch, labels)
    loss.backward()
    assert torch.isfinite(loss) and built.model.model.multi_modal_projector.linear_1.weight.grad.abs().sum() > 0


def test_bad_records_fail_in_one_line_naming_the_record(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps([{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "ho"}]},
                                {"image": "a.png", "conversations": [{"from": "human", "value": "<image> <image>"},
                                                                     {"from": "gpt", "value": "x"}]}]))
    with pytest.raises(sources.DataError, match=r"bad.json record 1: 2 <image> marker\(s\) for 1 image"):
        sources.load_records(str(path))
    with pytest.raises(sources.DataError, match="data file not found"):
        sources.check_spec(str(tmp_path / "missing.json"))
    with pytest.raises(sources.DataError, match="unknown data spec"):
        sources.check_spec("imagenet")


def test_truncation_drops_an_image_it_would_cut(built):
    enc = _encoder(built, max_length=9)  # BOS, "<|user|>", "\n", 4 + 4 image tokens, ...: the second image is cut
    out = enc({"images": [np.zeros((8, 8, 3), np.uint8)] * 2,
               "messages": [{"role": "user", "content": "<image><image>\nTwo squares?"}, {"role": "assistant", "content": "Yes."}]})
    n_img = int((out["input_ids"] == built.tokenizer.convert_tokens_to_ids(built.image_token)).sum())
    assert len(out["input_ids"]) <= 9 and n_img == 4 * len(out["images"]) and len(out["images"]) == 1
