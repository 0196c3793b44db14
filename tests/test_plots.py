"""Plots a person can read. Each plot kind is rendered on a small case and the
ranges it returns are checked: masses on 0..1 whatever the data, log-odds on one symmetric range
shared by the base and VLM panels, clipped values always marked, no offset notation on any axis,
and recovery drawn only where there is a loss to recover."""

import math

import pytest
import torch

from evals.sink.maps import SinkMaps


def _maps(mass, logodds, name="m") -> SinkMaps:
    mass = torch.tensor(mass, dtype=torch.float64)
    L, H = mass.shape
    lo = torch.tensor(logodds, dtype=torch.float64)[..., None].expand(L, H, 3).clone()
    return SinkMaps(mass=mass, mass_per_text=mass[None], argmax_key=torch.zeros(1, L, H, dtype=torch.long), argmax_mass=mass,
                    logodds=lo, logodds_query=lo, query_text=torch.zeros(3, dtype=torch.long), query_pos=torch.arange(3),
                    text_ids=["t0"], n_tokens=[8], texts_fingerprint="sha256:x",
                    settings={"sink_position": 0, "calibration": "tiny", "skip_queries": 1}, model={"name_or_path": name})


def test_sink_map_mass_uses_the_whole_range_and_log_odds_a_symmetric_stated_one(tmp_path):
    from evals.sink import plot_sink_map

    quiet = _maps([[0.051, 0.08], [0.1, 0.106]], [[-3.1, -3.5], [-3.9, -3.2]])  # what looked dramatic on an auto scale
    mass = plot_sink_map(quiet, tmp_path / "mass.png", metric="mass")
    (panel,) = mass["panels"]
    assert (panel["vmin"], panel["vmax"]) == (0.0, 1.0) and panel["data_max"] == pytest.approx(0.106)
    assert "mass colour range 0 to 1" in mass["note"]
    lo = plot_sink_map(quiet, tmp_path / "lo.png", metric="logodds")
    (panel,) = lo["panels"]
    assert (panel["vmin"], panel["vmax"]) == (pytest.approx(-3.9), pytest.approx(3.9)) and panel["cmap"] == "RdBu_r"
    assert "±3.90" in lo["note"] and "values -3.90 to -3.10" in lo["note"] and panel["clipped"] == "neither"
    assert (tmp_path / "lo.png").stat().st_size > 1000 and (tmp_path / "lo.svg").is_file()


def test_sink_shift_maps_share_one_range_and_the_shift_states_its_own(tmp_path):
    from evals.sink import plot_sink_shift

    base = _maps([[0.9, 0.2], [0.5, 0.1]], [[2.0, -1.0], [0.5, -3.0]], "base")
    vlm = _maps([[0.88, 0.2], [0.5, 0.13]], [[1.9, -1.0], [0.5, -3.05]], "vlm")
    lo = plot_sink_shift(base, vlm, tmp_path / "lo.png", metric="logodds", names=("base", "VLM LM"))
    left, right, shift = lo["panels"]
    assert left["vmin"] == right["vmin"] == pytest.approx(-3.05) and left["vmax"] == right["vmax"] == pytest.approx(3.05)
    assert (shift["vmin"], shift["vmax"]) == (pytest.approx(-0.1), pytest.approx(0.1)) and "±0.1" in shift["label"]
    mass = plot_sink_shift(base, vlm, tmp_path / "mass.png", metric="mass")
    left, right, shift = mass["panels"]
    assert (left["vmin"], left["vmax"]) == (right["vmin"], right["vmax"]) == (0.0, 1.0)
    assert shift["vmax"] == pytest.approx(0.03) and "±0.03" in shift["label"] and shift["clipped"] == "neither"


def test_layer_profiles_of_mass_span_zero_to_one_without_offsets(tmp_path):
    from evals.sink.plot import plot_layer_profiles

    facts = plot_layer_profiles({"base": _maps([[0.0500001, 0.0500002], [0.0500003, 0.0500004]], [[0, 0], [0, 0]])}, tmp_path / "p.png")
    assert facts["axes"]["ylim"] == (0.0, 1.0) and facts["axes"]["offset"] == ["", ""]


def test_trajectory_reads_s_as_s(tmp_path):
    """S moving by hundred-millionths around −0.0006 read as "1e−8 −6e−4" plus small ticks with matplotlib's offset notation."""
    from interventions.adapt.trajectory_plot import plot_trajectories

    points = [{"step": i, "stage_step": i, "sink_strength": -0.0006 - 1e-8 * i, "scores": {"t": 0.5 + 0.01 * i}} for i in range(4)]
    drawn = plot_trajectories({"arm": points}, tmp_path / "traj.png", svg=True)
    assert drawn["path"].is_file() and drawn["svg"].is_file()
    s_axis, score_axis = drawn["axes"]
    assert s_axis["offset"] == ["", ""] and score_axis["offset"] == ["", ""]
    assert s_axis["ylim"][0] < -0.00060003 and s_axis["ylim"][1] > -0.0006


def _summary(rows: dict) -> dict:
    """A study summary's pairs with one intervention each: {pair: (loss CI, recovery record)}."""
    pairs = {}
    for p, (loss_ci, rec) in rows.items():
        pairs[p] = {"models": {"base": {"sink_strength": 0.5 + len(pairs)}},
                    "degradation": {"t": {"delta_points": -10.0 + 5 * len(pairs), "delta_points_ci": loss_ci,
                                          "delta_relative": -0.2, "delta_relative_ci": [-0.3, -0.1]}},
                    "interventions": {"merge": {"t": {"recovery": rec}}}}
    return {"pairs": pairs, "correlation": {}}


def test_recovery_marks_every_clip_names_no_loss_and_uses_one_colour(tmp_path):
    from experiments.report import plots

    summary = _summary({
        "far": ([-30.0, -5.0], {"recovery": -2.33, "ci": [-12.0, -0.73], "status": "recovery"}),  # the estimate off the axis
        "wide": ([-30.0, -5.0], {"recovery": 0.4, "ci": [-0.5, 9.0], "status": "recovery"}),
        "flat": ([-4.0, 6.0], {"recovery": None, "ci": [None, None], "status": "no loss to recover"}),
    })
    facts = plots.recovery(summary, "t", tmp_path)
    rows = {r["label"].split(" / ")[0]: r for r in facts["rows"]}
    assert tuple(facts["axis"]) == plots.RECOVERY_AXIS
    assert rows["far"]["marks"] == ["ci <", "estimate"] and rows["wide"]["marks"] == ["ci >"]
    assert rows["flat"]["value"] is None and rows["flat"]["status"] == "no loss to recover" and rows["flat"]["marks"] == []
    (axis,) = facts["axes"]
    pad = 0.05 * (plots.RECOVERY_AXIS[1] - plots.RECOVERY_AXIS[0])
    assert axis["xlim"] == pytest.approx([plots.RECOVERY_AXIS[0] - pad, plots.RECOVERY_AXIS[1] + pad])
    assert (tmp_path / facts["path"]).is_file() and (tmp_path / facts["svg"]).is_file()
    svg = (tmp_path / facts["svg"]).read_text()
    assert "#2ca02c" not in svg  # tab:green: nothing is coloured as good or bad


def test_scatter_pretrain_and_sweep_pareto_return_their_axes(tmp_path):
    from experiments.report import plots
    from experiments.report.treatments import plot_pareto

    summary = _summary({p: ([-30.0, -5.0], {"recovery": 0.5, "ci": [0.1, 0.9], "status": "recovery"}) for p in ("a", "b", "c")})
    scatter = plots.scatter(summary, "t", tmp_path)
    points, relative = scatter["axes"]
    xs = [p["s"] for p in scatter["panels"][0]["points"]]
    assert points["xlim"][0] <= min(xs) and points["xlim"][1] >= max(xs) and points["offset"] == ["", ""]
    curves = plots.pretrain_sink_curves({"bb": [{"step": 0, "S": -3.4}, {"step": 50, "S": -1.1}]}, tmp_path)
    (axis,) = curves["axes"]
    assert axis["ylim"][0] <= -3.4 and axis["ylim"][1] >= -1.1
    rows = [{"name": f"p{i}", "method": "linear", "weight_distance_to_vlm": d, "caption_nll": None,
             "tasks": {"t": {"recovery": r, "ci": [None, None], "status": "recovery" if r is not None else "no loss to recover"}}}
            for i, (d, r) in enumerate([(0.2, 0.1), (0.8, 0.9), (0.5, None)])]
    drawn = plot_pareto(rows, tmp_path / "pareto.png")
    assert [p["name"] for p in drawn["points"]] == ["p0", "p1"]  # p2 had no loss to recover: left out
    (axis,) = drawn["axes"]
    assert axis["xlim"][0] <= 0.2 and axis["xlim"][1] >= 0.8 and not math.isnan(axis["ylim"][0])


def test_a_figure_is_drawn_whenever_the_report_is_written(tmp_path, monkeypatch):
    """A figure is no result: nothing of it is kept to be reused, each report draws it, the same record for the same
    inputs."""
    from evals.sink import plot as sink_plot
    from experiments.report import plots

    drawn = []
    real_save = sink_plot.save_png_svg
    monkeypatch.setattr(plots, "save_png_svg", lambda fig, path, **kw: drawn.append(path.name) or real_save(fig, path, **kw))
    summary = _summary({"p1": ([-30.0, -5.0], {"recovery": 0.4, "ci": [0.1, 0.9], "status": "recovery"})})
    first = plots.recovery(summary, "t", tmp_path)
    assert plots.recovery(summary, "t", tmp_path) == first and drawn == ["recovery_t.png"] * 2
    assert not (tmp_path / "plots" / ".reuse").exists()


def test_the_heat_maps_footer_is_drawn_whole_below_the_axes(tmp_path, monkeypatch):
    """sink_map.png's note ran off both edges of the one-panel figure and over the layer axis's label."""
    from evals.sink import plot as sink_plot

    drawn = {}
    save = sink_plot.save_png_svg

    def look(fig, path, on_drawn=None, **kw):
        def read(f):
            renderer = f.canvas.get_renderer()
            note = f.texts[-1].get_window_extent(renderer)
            axes = [ax.get_tightbbox(renderer) for ax in f.axes]
            drawn.update(inside=note.x0 >= 0 and note.x1 <= f.bbox.x1 and note.y0 >= 0,
                         below=all(note.y1 <= a.y0 + 1 for a in axes))
        return save(fig, path, on_drawn=read, **kw)

    monkeypatch.setattr(sink_plot, "save_png_svg", look)
    maps = _maps([[0.05, 0.9], [0.1, 0.106]], [[-3.1, 2.5], [-3.9, -3.2]])
    for metric in ("logodds", "mass"):
        sink_plot.plot_sink_map(maps, tmp_path / f"{metric}.png", metric=metric)
        assert drawn == {"inside": True, "below": True}, metric
