"""The study report: the answers first (one line per question the summary holds, number + CI + convention + rule),
the paper beside ours, readable HTML (tables that scroll in their box, examples as text, every file
linked), and figures that follow the data they claim (colour ranges, ρ in the scatter's title,
recovery dots and CIs, per-layer profiles, trajectories, Pareto).

The summary is built the way `experiments.study.summarise.summarise` builds it: real sink maps of tiny
models (`compute_sink_maps`), real paired statistics (`evals.stats`) over per-prompt outcomes; the report
is rendered from it alone.
"""

import json
import re
import types

import numpy as np
import pytest
import torch

from evals.eval_run import HEADLINE_METRICS

TASKS = ["sinkstudy_ifeval", "sinkstudy_gsm"]
TEXTS = ["The cat sat on the mat and looked at the bird.", "def add(a, b):\n    return a + b\n",
         "Write your answer in upper case letters only, please."]
N = 60
KW = {"n_boot": 400, "confidence": 0.95, "seed": 0}
DEMO_PROMPT = ("<|bos|><|user|>\nDescribe the vase in one sentence. Wrap your entire response with double quotation marks."
               "<|end|>\n<|assistant|>\n")
CHATML_PROMPT = "<|im_start|>user\nQ: Lena has 8 vases and gives away 6. How many vases are left?\nA:<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def _outcomes(n_lost: int, n_regained: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-prompt passes: the base passes 40 of N, the VLM LM loses `n_lost` of them, an intervention
    gets `n_regained` of those back."""
    base = np.array([1] * 40 + [0] * (N - 40), dtype=bool)
    vlm = base.copy()
    vlm[:n_lost] = False
    fixed = vlm.copy()
    fixed[:n_regained] = True
    return base, vlm, fixed


@pytest.fixture(scope="module")
def maps_dir(tmp_path_factory, tokenizer):
    """Real sink maps (JSON) of five tiny random LMs: two Qwen3 (native QK-norm) and three Qwen2."""
    from evals.sink import compute_sink_maps
    from sinkstudy.tiny import tiny_causal_lm

    d = tmp_path_factory.mktemp("maps")
    for i, family in enumerate(["qwen3", "qwen3", "qwen2", "qwen2", "qwen2"]):
        maps = compute_sink_maps(tiny_causal_lm(family, seed=i), tokenizer, TEXTS, progress=False)
        maps.model = {"name_or_path": f"tiny-{family}-{i}"}
        (d / f"m{i}.json").write_text(json.dumps(maps.to_json(), allow_nan=False))
    return d


def _model(maps_file, method=None, scores=None):
    from evals.sink import SinkMaps, strength_from_maps

    maps = SinkMaps.from_json(maps_file)
    return {"path": str(maps_file.parent / "model"), "sink_strength": strength_from_maps(maps, "logodds").value,
            "mean_mass": float(maps.mass.mean()), "sink_maps": str(maps_file), "scores": scores or {}, "method": method}


def make_summary(maps_dir, *, n_pairs: int = 3, interventions: bool = True, protection: bool = True) -> dict:
    """A summary as the runner writes it (see the module docstring)."""
    from evals.stats import CONVENTION, compare, recovery, sink_correlation

    losses = [4, 12, 20][:n_pairs]  # pair i loses losses[i] of the base's 40 passes on both tasks
    pairs = {}
    for i, lost in enumerate(losses):
        p = f"p{i}"
        base, vlm, _ = _outcomes(lost)
        runs = {"base": base, "vlm": vlm}
        models = {"base": _model(maps_dir / f"m{i}.json"), "vlm": _model(maps_dir / f"m{(i + 1) % 5}.json")}
        if interventions:
            for label, method, regained, m in (("linear", "linear", lost // 2, 2), ("head_restore", "head_restore", 0, 3),
                                               ("qknorm-vl", "qknorm+vl", lost - 2, 4)):
                runs[label] = _outcomes(lost, regained)[2]
                models[label] = _model(maps_dir / f"m{m}.json", method)
        if protection:
            runs["replay"] = _outcomes(lost, lost)[2]
            models["replay"] = _model(maps_dir / f"m{(i + 2) % 5}.json", "protection")
        for label, passes in runs.items():
            models[label]["scores"] = {t: {HEADLINE_METRICS[t]: float(passes.mean())} for t in TASKS}
        entry = {"models": models, "native_qk_norm": i == 0, "published": None,
                 "degradation": {t: compare(base, vlm, t, HEADLINE_METRICS[t], **KW).as_dict() for t in TASKS},
                 "interventions": {label: {t: {"recovery": recovery(base, vlm, runs[label], t, HEADLINE_METRICS[t], **KW).as_dict(),
                                               "vs_base": compare(base, runs[label], t, HEADLINE_METRICS[t], **KW).as_dict(),
                                               "vs_vlm": compare(vlm, runs[label], t, HEADLINE_METRICS[t], **KW).as_dict()}
                                           for t in TASKS}
                                   for label in runs if label not in ("base", "vlm")},
                 "examples": [{"doc_id": 3, "prompt": DEMO_PROMPT, "base": '"The owl is a white bird."', "vlm": "The owl is",
                               "base_pass": True, "vlm_pass": False, "target": 0,
                               "base_graded": {"extracted": None, "instructions": [True]},
                               "vlm_graded": {"extracted": None, "instructions": [False]}}] if i == 1 else []}
        if protection:
            traj = lambda s0, ds: [{"step": k, "stage": "stage1" if k < 2 else "stage2", "stage_step": k % 2,  # noqa: E731
                                    "sink_strength": s0 + ds * k, "scores": {"sinkstudy_gsm": 0.5 - 0.05 * k}} for k in range(4)]
            entry["protection"] = {"arms": {
                "control": {"label": "vlm", "protections": [], "vl_skill": {"digit_accuracy": 0.4},
                            "sink_strength": models["vlm"]["sink_strength"], "adapt": {"stages": [], "trajectory": traj(0.5, -0.1)}},
                "replay": {"label": "replay", "protections": ["text_replay"], "vl_skill": {"digit_accuracy": 0.35},
                           "sink_strength": models["replay"]["sink_strength"], "adapt": {"stages": [], "trajectory": traj(0.5, 0.05)},
                           "vs_control": {t: compare(vlm, runs["replay"], t, HEADLINE_METRICS[t], **KW).as_dict() for t in TASKS}}}}
        pairs[p] = entry
    pairs["p1"]["published"] = {"sink_strength": 1.18, "ifeval_delta": -9.6, "ifeval_base": 72.09}
    summary = {"study": "t", "tasks": TASKS, "headline": {t: HEADLINE_METRICS[t] for t in TASKS}, "convention": CONVENTION,
               "pairs": pairs, "correlation": {}, "timings": {},
               "settings": {"title": None, "notes": None, "sink_metric": "logodds", "apply_chat_template": True, "max_gen_toks": 64,
                            "batch_size": 8, "n_boot": KW["n_boot"], "confidence": 0.95,
                            "interventions": ["linear", "head_restore", "qknorm"], "config": "study.yaml", "out": "OUT", "seed": 0}}
    if n_pairs >= 3:
        for t in TASKS:
            s = [e["models"]["base"]["sink_strength"] for e in pairs.values()]
            d = [e["degradation"][t] for e in pairs.values()]
            summary["correlation"][t] = sink_correlation(s, [c["delta_points"] for c in d], [c["delta_relative"] for c in d],
                                                         **KW).as_dict()
    return summary


@pytest.fixture(scope="module")
def report(maps_dir, tmp_path_factory):
    from experiments.report.document import write_report

    out = tmp_path_factory.mktemp("report")
    summary = make_summary(maps_dir)
    md = write_report(summary, out)
    return types.SimpleNamespace(out=out, summary=summary, md=md.read_text(), html=(out / "report.html").read_text())


def _section(md: str, heading: str) -> str:
    return md.split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]


# --------------------------------------------------------------------------- the answers first


def test_the_report_opens_with_one_line_per_question_and_no_second_decision(report):
    from experiments.report.fmt import ci_text

    md, summary = report.md, report.summary
    assert re.findall(r"^## .*", md, flags=re.M)[:2] == ["## The paper's claims", "## Paper vs ours"]
    assert "## Verdicts" not in md  # every answer is the claims'
    lines = [x[2:] for x in _section(md, "The paper's claims").strip().splitlines()]
    questions = [x.split(" — ")[0] for x in lines]
    assert questions == ["VL training costs text skill on strict graders (sinkstudy_ifeval)",
                         "A stronger sink (higher S of the base) predicts less loss",
                         "Backbones with QK-norm of their own lose less text skill through VL training",
                         "QK-RMSNorm injected after pretraining does not protect text skill through VL training",
                         "Merging the base and the VLM LM after VL training does not recover the loss",
                         "Open direction: does replay (text_replay) keep more text skill than the unprotected adaptation",
                         "Open direction: does mitigation head_restore keep more text skill than its control (the unmitigated VLM LM)"]
    # S: both relations with the number and CI the summary holds, the convention and the paper's figures in it.
    corr = summary["correlation"]["sinkstudy_ifeval"]
    pts, rel = corr["points"], corr["relative"]
    sink = lines[1]
    assert f"ρ(S, Δ points) = {pts['spearman']:+.3f} {ci_text(pts['spearman_ci'], '.3f')}" in sink
    assert f"ρ(S, Δ/base) = {rel['spearman']:+.3f} {ci_text(rel['spearman_ci'], '.3f')}" in sink
    assert "(ρ > 0: a stronger sink, less loss" in sink and "ρ = +0.971 on points and +0.794 on Δ/base" in sink
    # QK-norm: against the control (Δ = qknorm-vl − VLM LM) and against the base (Δ/base), with the native pair's.
    c = summary["pairs"]["p2"]["interventions"]["qknorm-vl"]["sinkstudy_ifeval"]["vs_vlm"]
    q = lines[3]
    assert f"p2 qknorm-vl: Δ = injected + VL − VLM LM = {c['delta_points']:+.1f} [{c['delta_points_ci'][0]:.1f}, " \
           f"{c['delta_points_ci'][1]:.1f}] pts, against the base Δ/base = " in q
    assert "native QK-norm pairs from VL training: p0 Δ/base =" in q and "Qwen2.5-3B-Instruct" in q
    # Merges: per (pair, merge) with a significant loss, the share recovered with its CI, and the one rule's count.
    merge = lines[4]
    for p in ("p1", "p2"):
        r = summary["pairs"][p]["interventions"]["linear"]["sinkstudy_ifeval"]["recovery"]
        assert f"{p}/linear {r['recovery']:.2f} [{r['ci'][0]:.2f}, {r['ci'][1]:.2f}]" in merge
    assert "none of its 7 merges recovered IFEval" in merge
    # The protection and the mitigation, each against its control with Δ in points and CI.
    assert lines[5].split(" — ")[1].startswith("yes: ") and "VL skill 0.35" in lines[5]
    assert lines[6].split(" — ")[1].startswith("not established")  # it regained nothing


def test_paper_vs_ours_table_sets_each_published_figure_beside_ours(report):
    table = _section(report.md, "Paper vs ours")
    rows = {r.split(" | ")[0].lstrip("| "): r for r in table.splitlines() if r.startswith("| ") and "---" not in r}
    assert set(rows) == {"figure", "ρ(S, Δ points)", "ρ(S, Δ/base)", "Δ points, p1", "Δ points from VL training, p0",
                         "Δ points from VL training, p2", "injected QK-norm + VL training, Δ/base, p0",
                         "injected QK-norm + VL training, Δ/base, p1", "injected QK-norm + VL training, Δ/base, p2",
                         "merges that recover the loss"}
    d = report.summary["pairs"]["p1"]["degradation"]["sinkstudy_ifeval"]
    assert "| -9.6 |" in rows["Δ points, p1"] and f"{d['delta_points']:+.1f} pts" in rows["Δ points, p1"]
    assert rows["Δ points, p1"].endswith("same sign |")  # both lost: our CI lies below 0
    assert "| +0.971 (6 pairs) |" in rows["ρ(S, Δ points)"]
    assert "| -0.816 (Qwen2.5-3B-Instruct) |" in rows["injected QK-norm + VL training, Δ/base, p2"]
    assert "| 0 of 7 |" in rows["merges that recover the loss"]


def test_pairs_and_unit_gain_arms_the_paper_did_not_measure_stand_beside_its_range_and_its_injection(maps_dir):
    """A pair without published figures is set beside the range of the paper's six Δs (per control seed); an arm
    trained from a base with the paper's unit-gain QK-norm beside the paper's injection, a scale-preserving one not."""
    from experiments.report.findings import paper_rows
    from experiments.report.results import StudyResults

    summary = make_summary(maps_dir)
    arms = summary["pairs"]["p2"]["protection"]["arms"]
    for name, init in (("qk-unit", "identity-gain"), ("qk-scale", "scale-preserving")):
        arms[name] = {**arms["replay"], "label": "qknorm-vl", "protections": [], "qknorm": {"init": init}}
    rows = {row[0]: row[1:] for row in paper_rows(StudyResults.of(summary))}
    assert "injected QK-norm + VL training, Δ/base, p2 qk-unit" in rows and not any("qk-scale" in k for k in rows)
    assert rows["injected QK-norm + VL training, Δ/base, p2 qk-unit"][0] == "-0.816 (Qwen2.5-3B-Instruct)"
    for p in ("p0", "p2"):
        paper, ours, agreement = rows[f"Δ points from VL training, {p}"]
        lo, hi = summary["pairs"][p]["degradation"]["sinkstudy_ifeval"]["delta_points_ci"]
        assert paper == "-1.8 to -18.7 (six pairs)" and hi < 0 and agreement.startswith("same sign")
        assert agreement.endswith("overlaps the paper's range") is (lo <= -1.8 and hi >= -18.7)


def test_missing_parts_are_skipped_not_printed_empty(maps_dir, tmp_path):
    from experiments.report.document import answers, build_blocks

    summary = make_summary(maps_dir, n_pairs=2, interventions=False, protection=False)
    assert [a.split(" — ")[0] for a in answers(summary)] == [  # two pairs: no correlation; no intervention, no arm
        "VL training costs text skill on strict graders (sinkstudy_ifeval)", "A stronger sink (higher S of the base) predicts less loss",
        "Backbones with QK-norm of their own lose less text skill through VL training"]
    blocks = build_blocks(summary, tmp_path)
    headings = [b[2] for b in blocks if b[0] == "h"]
    assert "Recovery per intervention" not in headings and "Training-time protections" not in headings
    assert "Paper vs ours" in headings  # p1 carries a published Δ
    for i, b in enumerate(blocks):  # every heading is followed by content
        if b[0] == "h" and b[1] == 2:
            assert i + 1 < len(blocks) and blocks[i + 1][0] != "h", b
        if b[0] in ("ul", "links"):
            assert b[1]
        if b[0] == "table":
            assert b[2]


# --------------------------------------------------------------------------- HTML, examples, links


def test_html_tables_scroll_in_their_box_and_every_figure_and_file_is_linked(report):
    html, out = report.html, report.out
    assert ".table{overflow-x:auto" in html
    assert html.count("<table>") == html.count("<div class='table'><table>") == report.md.count("\n|---") > 0
    pngs = re.findall(r'<img src="([^"]+)"', html)
    assert len(pngs) >= 10
    for png in pngs:
        svg = png[:-4] + ".svg"
        assert (out / png).read_bytes()[:4] == b"\x89PNG" and (out / svg).read_text().lstrip().startswith("<?xml")
        assert f'<a href="{png}">PNG</a>, <a href="{svg}">SVG</a>' in html and f"[SVG]({svg})" in report.md
    files = _section(report.md, "Files")
    for png in pngs:
        assert f"- [{png}]({png})" in files
    maps = report.summary["pairs"]["p0"]["models"]["base"]["sink_maps"]
    assert f"p0 / base: sink maps (JSON)](file://{maps})" in files and "[summary.json (every number in this report)](summary.json)" in files


def test_examples_are_text_with_prompt_expected_answer_and_verdict(report):
    section = _section(report.md, "Example outputs on sinkstudy_ifeval (prompts the base passes and the VLM LM fails, where any)")
    assert "<|" not in section and "\\n" not in section
    assert "Describe the vase in one sentence. Wrap your entire response with double quotation marks." in section
    assert "Expected: a response that follows every instruction in the prompt" in section
    assert "base: **pass (1 of 1 instructions followed)**" in section and "VLM LM: **fail (0 of 1 instructions followed)**" in section
    assert "<pre class='text'>Describe the vase in one sentence." in report.html and "&lt;|" not in report.html


def test_chat_markup_is_removed_from_prompts():
    from experiments.report.document import chat_text

    assert chat_text(DEMO_PROMPT) == ("Describe the vase in one sentence. Wrap your entire response with double quotation marks.")
    assert chat_text(CHATML_PROMPT) == "Q: Lena has 8 vases and gives away 6. How many vases are left?\nA:"
    llama3 = ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|><|start_header_id|>user"
              "<|end_header_id|>\n\nList <<two>> fruits.<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")
    assert chat_text(llama3) == "Be brief.\n\nList <<two>> fruits."  # IFEval's <<title>> markers are kept


# --------------------------------------------------------------------------- figures follow their data


def test_sink_maps_colour_ranges_follow_the_values_and_the_metric(maps_dir, tmp_path):
    from evals.sink import SinkMaps, plot_sink_shift

    a, b = SinkMaps.from_json(maps_dir / "m2.json"), SinkMaps.from_json(maps_dir / "m3.json")
    lo_a, lo_b = (torch.from_numpy(np.nanmedian(m.logodds.double().numpy(), -1)) for m in (a, b))
    facts = plot_sink_shift(a, b, tmp_path / "lo.png", metric="logodds")
    left, right, shift = facts["panels"]
    bound = float(torch.cat([lo_a.flatten(), lo_b.flatten()]).abs().max())
    assert left["vmin"] == right["vmin"] == pytest.approx(-bound) and left["vmax"] == right["vmax"] == pytest.approx(bound)
    assert left["cmap"] == "RdBu_r" and shift["vmax"] == pytest.approx(float((lo_b - lo_a).abs().max())) == -shift["vmin"]
    values = torch.cat([lo_a.flatten(), lo_b.flatten()])
    assert f"±{bound:.2f}" in facts["note"] and f"values {float(values.min()):.2f} to {float(values.max()):.2f}" in facts["note"]
    assert (tmp_path / "lo.png").stat().st_size > 1000 and (tmp_path / "lo.svg").is_file()

    mass = plot_sink_shift(a, b, tmp_path / "mass.png", metric="mass")
    both = torch.cat([a.mass.flatten(), b.mass.flatten()])
    # Masses on their whole range 0..1, whatever the data (an auto range made noise look dramatic).
    assert (mass["panels"][0]["vmin"], mass["panels"][1]["vmax"]) == (0.0, 1.0) and mass["panels"][0]["cmap"] == "viridis"
    assert mass["panels"][0]["data_max"] == pytest.approx(float(a.mass.max())) and "mass colour range 0 to 1" in mass["note"]
    # Halve B's mass: the maps keep 0..1, the shift's own range moves with the values.
    b.mass = b.mass / 2
    halved = plot_sink_shift(a, b, tmp_path / "mass2.png", metric="mass")
    both = torch.cat([a.mass.flatten(), b.mass.flatten()])
    assert halved["panels"][0]["vmin"] == 0.0
    assert halved["panels"][2]["vmax"] == pytest.approx(float((b.mass - a.mass).abs().max()))
    # Maps stored without per-query log-odds (a large model's JSON): both panels fall back to mass, and say so.
    b.logodds = None
    fallback = plot_sink_shift(a, b, tmp_path / "fallback.png", metric="logodds")
    assert fallback["panels"][0]["cmap"] == "viridis" and fallback["panels"][0]["vmin"] == 0.0
    assert fallback["panels"][0]["label"].endswith("(no per-query log-odds stored)")


def test_report_sink_maps_and_profiles_use_the_study_metric(report, maps_dir):
    from evals.sink import SinkMaps
    from experiments.report import plots

    summary, out = report.summary, report.out
    figs = plots.sink_maps(summary, "logodds", out)
    base = SinkMaps.from_json(summary["pairs"]["p1"]["models"]["base"]["sink_maps"])
    assert figs["p1"]["panels"][0]["label"].startswith("base: median log-odds")
    assert figs["p1"]["panels"][0]["data_max"] == pytest.approx(float(np.nanmax(np.nanmedian(base.logodds.double().numpy(), -1))))
    profiles = plots.layer_profiles(summary, "logodds", out)
    lines = profiles["p1"]["lines"]
    assert set(lines) == {"base", "VLM LM", "linear", "head_restore", "qknorm-vl", "replay"}
    lo = base.logodds.double().numpy()
    assert lines["base"] == pytest.approx([float(np.nanmedian(lo[i])) for i in range(base.num_layers)])
    mass = plots.layer_profiles(summary, "mass", out)["p1"]["lines"]["base"]
    assert mass == pytest.approx(base.mass.mean(-1).tolist()) and (out / profiles["p1"]["svg"]).is_file()


def test_scatter_title_holds_the_rho_of_the_plotted_points(report):
    from scipy.stats import spearmanr

    from experiments.report import plots

    fig = plots.scatter(report.summary, "sinkstudy_ifeval", report.out)
    corr = report.summary["correlation"]["sinkstudy_ifeval"]
    for panel, key in zip(fig["panels"], ("points", "relative")):
        assert [p["pair"] for p in panel["points"]] == ["p0", "p1", "p2"]
        rho = spearmanr([p["s"] for p in panel["points"]], [p["y"] for p in panel["points"]]).statistic
        lo, hi = corr[key]["spearman_ci"]
        assert f"= {rho:+.2f} [{lo:+.2f}, {hi:+.2f}], n = 3" in panel["title"]
    uncorrelated = {**report.summary, "correlation": {}}  # fewer than 3 defined pairs: the title says so
    assert "needs ≥ 3 pairs" in plots.scatter(uncorrelated, "sinkstudy_ifeval", report.out)["panels"][0]["title"]


def test_recovery_is_a_dot_and_ci_per_pair_and_intervention(report):
    from experiments.report import plots

    fig = plots.recovery(report.summary, "sinkstudy_ifeval", report.out)
    rows = {r["label"]: r for r in fig["rows"]}
    assert len(rows) == 3 * 4
    r = report.summary["pairs"]["p2"]["interventions"]["linear"]["sinkstudy_ifeval"]["recovery"]
    assert (rows["p2 / linear"]["value"], rows["p2 / linear"]["lo"], rows["p2 / linear"]["hi"]) == (r["recovery"], *r["ci"])
    assert rows["p2 / linear"]["status"] == "recovery" and rows["p2 / linear"]["value"] == pytest.approx(0.5)  # regained 10 of 20
    assert rows["p2 / replay"]["value"] == pytest.approx(1.0) and rows["p2 / head_restore"]["value"] == pytest.approx(0.0)
    # The axis spans the data and 0..1: here every CI lies within 0..1.
    stated = [r for r in rows.values() if r["status"] == "recovery"]
    assert fig["axis"] == pytest.approx([min(0.0, *(r["lo"] for r in stated)), max(1.0, *(r["hi"] for r in stated))])
    empty = {**report.summary, "pairs": {p: {**e, "interventions": {}} for p, e in report.summary["pairs"].items()}}
    assert plots.recovery(empty, "sinkstudy_ifeval", report.out) is None


def test_adaptation_trajectories_and_pareto_come_from_the_arms(report):
    from experiments.report import plots

    traj = plots.adaptation_trajectory(report.summary, "p1", report.out)
    arms = report.summary["pairs"]["p1"]["protection"]["arms"]
    assert traj["lines"] == {a: arms[a]["adapt"]["trajectory"] for a in ("control", "replay")}
    assert (report.out / traj["path"]).is_file() and (report.out / traj["svg"]).is_file()
    pareto = plots.protect_pareto(report.summary, "sinkstudy_ifeval", report.out)
    got = {(p["pair"], p["arm"]): (p["skill"], p["score_points"]) for p in pareto["points"]}
    models = report.summary["pairs"]["p1"]["models"]
    assert got[("p1", "replay")] == (0.35, pytest.approx(100 * models["replay"]["scores"]["sinkstudy_ifeval"][HEADLINE_METRICS["sinkstudy_ifeval"]]))
    assert got[("p1", "control")][1] == pytest.approx(100 * (40 - 12) / N)


def test_sinkstudy_report_rerenders_a_run_from_its_summary_alone(report, tmp_path, capsys):
    """`sinkstudy report RUN_DIR`: the same report.md, report.html and figures from RUN_DIR/summary.json, with no
    step record or config in RUN_DIR; a directory without a summary is refused in one line."""
    from experiments.cli import main

    run = tmp_path / "run"
    run.mkdir()
    (run / "summary.json").write_text(json.dumps(report.summary))
    assert main(["report", str(run)]) == 0
    assert (run / "report.md").read_text() == report.md and (run / "report.html").read_text() == report.html
    pngs = re.findall(r'<img src="([^"]+)"', report.html)
    assert pngs and all((run / png).read_bytes()[:4] == b"\x89PNG" for png in pngs)
    assert sorted(p.name for p in run.iterdir()) == ["plots", "report.html", "report.md", "summary.json"]
    capsys.readouterr()
    assert main(["report", str(tmp_path / "empty")]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_see_also_links_related_reports_by_their_path_relative_to_this_one(maps_dir, tmp_path):
    from experiments.report.document import write_report

    summary = make_summary(maps_dir, n_pairs=2, interventions=False, protection=False)
    other = tmp_path / "study-real" / "report.md"
    summary["settings"]["see_also"] = {"The real-backbone study": str(other)}
    md = write_report(summary, tmp_path / "demo").read_text()
    assert "](../study-real/report.md)" not in md  # a report not written (yet) is not linked, and the report says so
    assert f"Not run yet, so not linked: The real-backbone study ({other})" in md.split("\n## ", 1)[0]
    other.parent.mkdir()
    other.write_text("# the other study\n")
    md = write_report(summary, tmp_path / "demo").read_text()
    assert "- [The real-backbone study](../study-real/report.md)" in md.split("\n## ", 1)[0]  # before the first section


def test_a_protection_note_says_which_chosen_heads_are_no_sink_heads():
    from experiments.report.document import _protection_note

    rep = {"heads": [{"layer": 0, "head": 1, "strength": -3.21, "mass": 0.04, "sink_head": False},
                     {"layer": 1, "head": 0, "strength": 0.8, "mass": 0.9, "sink_head": True}]}
    note = _protection_note("p / arm", "sink_head_freeze", "stage2", rep)
    assert note.endswith("L0H1 (S -3.21, mass 0.04), L1H0 (S 0.80, mass 0.90); 1 of them no sink head (mass <= 0.3)")
    rep["heads"] = rep["heads"][1:]
    assert "no sink head" not in _protection_note("p / arm", "sink_head_freeze", "stage2", rep)

