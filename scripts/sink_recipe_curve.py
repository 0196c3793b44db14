"""Train the sink recipes of experiments/demo/sinkgrow.py and measure S against training steps.

    python scripts/sink_recipe_curve.py --out runs/sinks [--recipes a,b] [--seeds 0,1] [--ifeval-limit 20]

For each (recipe, seed): S (the project's default log-odds Sink Strength on the ifeval15 chat
prompts), sink mass and the share of heads whose argmax key is BOS at checkpoints, the same on
held-out Bigram-Backcopy text, the held-out chat loss, sinkstudy_ifeval prompt-level strict
accuracy on held-out prompts (lm-eval), and the pretraining wall time (measurements excluded).
Writes <out>/results/<recipe>-s<seed>.json (reused on rerun unless --force), <out>/curve.json,
<out>/curve.png and <out>/table.md. Single-threaded by default: the machine is shared.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

HELDOUT_CHAT_SEED = 10_007  # a corpus sample the training corpus (seed 0) does not draw
BACKCOPY_EVAL_SEED = 777


def prepare(out: Path, corpus_cfg: dict, vocab_size: int):
    from experiments.demo import steps
    from sinkstudy.checkpoint import load_tokenizer

    data, tok_dir = out / "data", out / "models" / "tokenizer"
    if not (data / "train.jsonl").is_file():
        steps.make_corpus(data, corpus_cfg)
    if not (tok_dir / "tokenizer.json").is_file():
        steps.make_tokenizer(data, tok_dir, {"vocab_size": vocab_size})
    tok = load_tokenizer(tok_dir)
    return tok, steps.training_texts(data, tok), data


def run_one(recipe, tok, texts, data: Path, out: Path, every: int, ifeval_limit: int) -> dict:
    from experiments.demo import corpus, sinkgrow
    from evals.lmeval import run_eval
    from interventions.training import chat_text
    from sinkstudy.io import atomic_output_dir

    backcopy_eval = sinkgrow.bigram_backcopy_texts(tok, 15, BACKCOPY_EVAL_SEED, sinkgrow.BackcopyTask(length=48))

    def measure(model):
        chat = sinkgrow.sink_point(model, tok)
        bb = sinkgrow.sink_point(model, tok, texts=backcopy_eval, apply_chat_template=False)
        return {**chat, "backcopy": {k: bb[k] for k in ("S", "mass", "argmax_is_sink")}}

    checkpoints = sorted({0, recipe.steps, *range(every, recipe.steps, every)})
    model, res = sinkgrow.grow(recipe, tok, texts, checkpoints=checkpoints, measure=measure, progress=True)
    heldout = [chat_text(tok, u, a) if a is not None else u for u, a in corpus.training_records(200, HELDOUT_CHAT_SEED)]
    row = res.to_json()
    row["heldout_chat_loss"] = sinkgrow.heldout_chat_loss(model, tok, heldout, recipe.seq_len)
    if ifeval_limit:
        from experiments.demo.backbones import _set_generation_defaults

        _set_generation_defaults(model, tok)
        model_dir = out / "models" / f"{recipe.name}-s{recipe.seed}"
        with atomic_output_dir(model_dir, replace=True) as tmp:
            model.save_pretrained(tmp)
            tok.save_pretrained(tmp)
        ev = run_eval(model_dir, tasks=["sinkstudy_ifeval"], limit=ifeval_limit, batch_size=16, max_gen_toks=64,
                      data_files={"sinkstudy_ifeval": str(data / "heldout_ifeval.jsonl")}, progress=False)
        scores = ev.scores["sinkstudy_ifeval"]
        row["ifeval"] = {k: v for k, v in scores.items() if "strict" in k and "stderr" not in k}
        row["ifeval"]["n"] = ifeval_limit
    return row


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from sinkstudy.io import save_figure_atomic

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))
    names = list(dict.fromkeys(row["recipe"]["name"] for row in rows))
    colors = plt.get_cmap("tab10")
    for row in rows:
        r = row["recipe"]
        steps = [p["step"] for p in row["curve"]]
        # one colour per recipe, one line style per seed; the legend names each recipe once
        style = {"color": colors(names.index(r["name"]) % 10), "ls": "-" if r["seed"] == rows[0]["recipe"]["seed"] else "--",
                 "marker": ".", "label": r["name"] if r["seed"] == rows[0]["recipe"]["seed"] else None}
        axes[0].plot(steps, [p["S"] for p in row["curve"]], **style)
        axes[1].plot(steps, [p["mass"] for p in row["curve"]], **style)
        axes[2].plot(steps, [p["backcopy"]["S"] for p in row["curve"]], **style)
    for ax, title in zip(axes, ("S on ifeval15 chat prompts (default metric)", "sink mass (attention on BOS), chat prompts",
                                "S on held-out Bigram-Backcopy text")):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("training step")
    axes[0].set_ylabel("median log-odds on argmax key")
    axes[2].legend(fontsize=7, loc="best", title="dashed: other seed", title_fontsize=7)
    fig.tight_layout()
    save_figure_atomic(fig, path, dpi=110)
    plt.close(fig)


def table(rows: list[dict]) -> str:
    head = ("| recipe | seed | S (chat) | S per layer (chat) | S at step 0 | sink mass | argmax=BOS | S (BB text) | "
            "held-out chat loss | ifeval prompt-strict (n) | train s |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for row in rows:
        r, last, first = row["recipe"], row["curve"][-1], row["curve"][0]
        ife = row.get("ifeval") or {}
        strict = next((v for k, v in ife.items() if k.startswith("prompt_level_strict")), None)
        strict_txt = "-" if strict is None else f"{strict:.2f} ({ife['n']})"
        per_layer = " / ".join(f"{v:.2f}" for v in last.get("S_per_layer", []))
        lines.append(f"| {r['name']} | {r['seed']} | {last['S']:.2f} | {per_layer} | {first['S']:.2f} | {last['mass']:.3f} | "
                     f"{last['argmax_is_sink']:.2f} | {last['backcopy']['S']:.2f} | {row['heldout_chat_loss']:.3f} | "
                     f"{strict_txt} | {row['train_seconds']:.1f} |")
    return "\n".join(lines) + "\n"


def result_key(recipe, args) -> str:
    """A stored result is reused only for the same recipe, settings and code (this script and sinkgrow)."""
    import hashlib

    from experiments.demo import sinkgrow

    h = hashlib.sha256(json.dumps([recipe.to_json(), args.every, args.ifeval_limit]).encode())
    for source in (Path(__file__), Path(sinkgrow.__file__)):
        h.update(source.read_bytes())
    return "sha256:" + h.hexdigest()[:32]


def main(argv=None) -> int:
    from experiments.demo import sinkgrow
    from sinkstudy import SinkstudyError
    from sinkstudy.io import read_json, write_json_atomic, write_text_atomic
    from sinkstudy.provenance import provenance

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/sinks")
    ap.add_argument("--recipes", default=",".join(sinkgrow.RECIPES))
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--every", type=int, default=50, help="checkpoint interval in steps")
    ap.add_argument("--ifeval-limit", type=int, default=20, help="held-out sinkstudy_ifeval prompts (0 = skip)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--force", action="store_true")
    args = ap.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    try:
        names = [n for n in args.recipes.split(",") if n]
        seeds = [int(s) for s in args.seeds.split(",") if s]
        recipes = [sinkgrow.get_recipe(n, seed=s) for n in names for s in seeds]
    except (SinkstudyError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    tok, texts, data = prepare(out, {"train_records": 6000, "heldout_ifeval": 48, "heldout_gsm": 32, "seed": 0}, 1024)
    rows = []
    for recipe in recipes:
        path = out / "results" / f"{recipe.name}-s{recipe.seed}.json"
        key = result_key(recipe, args)
        if path.is_file() and not args.force and read_json(path).get("key") == key:
            rows.append(read_json(path))
            continue
        row = run_one(recipe, tok, texts, data, out, args.every, args.ifeval_limit)
        row["threads"] = torch.get_num_threads()
        row["key"] = key
        write_json_atomic(path, row)
        rows.append(row)
        last = row["curve"][-1]
        print(f"{recipe.name} s{recipe.seed}: S {row['curve'][0]['S']:.2f} -> {last['S']:.2f}, mass {last['mass']:.3f}, "
              f"BB-text S {last['backcopy']['S']:.2f}, chat loss {row['heldout_chat_loss']:.3f}, "
              f"ifeval {row.get('ifeval')}, train {row['train_seconds']:.1f}s", flush=True)
    write_json_atomic(out / "curve.json", {"rows": rows, "provenance": provenance(script="scripts/sink_recipe_curve.py",
                                                                                 threads=args.threads)})
    write_text_atomic(out / "table.md", table(rows))
    plot(rows, out / "curve.png")
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
