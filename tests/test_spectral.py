"""TSV and STAR: their arithmetic on small matrices with known spectra, then merges on disk."""

import pytest
import torch
from safetensors.torch import load_file

from tests.test_merge import _perturbed, _save_model, _w


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # Many tiny SVDs: with other jobs on the cores, OpenMP threads spin-wait on each call (measured
    # ~100x slower at 2 threads under load); one thread is fastest for these sizes anyway.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _orthonormal(n: int, k: int, seed: int) -> torch.Tensor:
    q, _ = torch.linalg.qr(torch.randn(n, n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64))
    return q[:, :k]


def _matrix(u, s, v):
    return (u * torch.tensor(s, dtype=u.dtype)) @ v.T


def test_star_keeps_eta_of_the_spectrum_and_the_nuclear_norm():
    from interventions.spectral import star_truncate

    u, v = _orthonormal(12, 5, 0), _orthonormal(9, 5, 1)
    s = [8.0, 4.0, 2.0, 1.0, 0.5]  # nuclear norm 15.5
    m = _matrix(u, s, v).float()
    # eta 40%: 8 >= 6.2, so rank 1, rescaled to 15.5.
    torch.testing.assert_close(star_truncate(m, 40), _matrix(u[:, :1], [15.5], v[:, :1]).float(), rtol=1e-4, atol=1e-5)
    # eta 60%: 8 < 9.3 <= 12, so rank 2, both scaled by 15.5 / 12.
    out = star_truncate(m, 60)
    torch.testing.assert_close(out, _matrix(u[:, :2], [8 * 15.5 / 12, 4 * 15.5 / 12], v[:, :2]).float(), rtol=1e-4, atol=1e-5)
    sv = torch.linalg.svdvals(out.double())
    assert abs(sv.sum().item() - 15.5) < 1e-4 and (sv[2:] < 1e-4).all()
    # eta 100%: everything kept, nothing rescaled.
    torch.testing.assert_close(star_truncate(m, 100), m, rtol=1e-4, atol=1e-5)


def test_tsv_keeps_top_singular_directions_of_each_task():
    from interventions.spectral import tsv_merge

    # Two tasks whose singular directions are mutually orthogonal: the orthogonalisation is then
    # the identity, and TSV = sum of each task's top-k truncation. Default k = min(m, n) / T = 4.
    uu, vv = _orthonormal(10, 8, 2), _orthonormal(8, 8, 3)
    u1, u2, v1, v2 = uu[:, :4], uu[:, 4:], vv[:, :4], vv[:, 4:]
    t1 = _matrix(u1, [5.0, 3.0, 0.2, 0.1], v1).float()
    t2 = _matrix(u2, [4.0, 2.0, 0.3, 0.1], v2).float()
    expected = _matrix(u1[:, :2], [5.0, 3.0], v1[:, :2]) + _matrix(u2[:, :2], [4.0, 2.0], v2[:, :2])
    torch.testing.assert_close(tsv_merge([t1, t2]), t1 + t2, rtol=1e-4, atol=1e-5)
    # k_fraction 1/4: k = 2, the small directions (0.2, 0.1 / 0.3, 0.1) are dropped.
    torch.testing.assert_close(tsv_merge([t1, t2], alpha=1.0, k_fraction=0.25), expected.float(), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(tsv_merge([t1, t2], alpha=0.5, k_fraction=0.25), 0.5 * expected.float(), rtol=1e-4, atol=1e-5)


def test_tsv_orthogonalises_overlapping_tasks_and_reduces_to_task_arithmetic_for_one():
    from interventions.spectral import tsv_merge

    g = torch.Generator().manual_seed(4)
    a, b = torch.randn(16, 12, generator=g), torch.randn(16, 12, generator=g)
    merged = tsv_merge([a, b])
    # U_perp and V_perp are orthonormal, so the merged singular values are exactly the kept ones.
    kept = torch.cat([torch.linalg.svdvals(a)[:6], torch.linalg.svdvals(b)[:6]]).sort(descending=True).values
    torch.testing.assert_close(torch.linalg.svdvals(merged), kept, rtol=1e-4, atol=1e-4)
    # One task vector: every direction kept, nothing to orthogonalise: alpha * delta.
    torch.testing.assert_close(tsv_merge([a], alpha=0.7), 0.7 * a, rtol=1e-4, atol=1e-5)


def test_one_dimensional_rules():
    from interventions.spectral import merge_tensor

    d1, d2 = torch.tensor([1.0, -2.0, 3.0]), torch.tensor([3.0, 2.0, -1.0])
    torch.testing.assert_close(merge_tensor("tsv", [d1, d2], alpha=2.0), 2.0 * (d1 + d2) / 2)
    torch.testing.assert_close(merge_tensor("star", [d1, d2], eta=40), (d1 + d2) / 2)
    torch.testing.assert_close(merge_tensor("star", [d1, d2], eta=40, lam=1.0), d1 + d2)


@pytest.fixture(scope="module")
def trio(tmp_path_factory, tokenizer):
    from sinkstudy.tiny import tiny_causal_lm

    d = tmp_path_factory.mktemp("spectral_pair")
    root = tiny_causal_lm("qwen2", seed=0)
    return {n: _save_model(m, tokenizer, d / n) for n, m in (("root", root), ("base", _perturbed(root, 1)), ("vlm", _perturbed(root, 2)))}


UP = "model.layers.1.mlp.up_proj.weight"


def test_tsv_on_disk(trio, tmp_path):
    from interventions.merge import RESULT_JSON
    from interventions.spectral import run_spectral_merge, tsv_merge

    out = run_spectral_merge("tsv", trio["base"], trio["vlm"], tmp_path / "tsv", weight=1.0, progress=False)
    b, v, m = _w(trio["base"]), _w(trio["vlm"]), _w(out)
    assert set(m) == set(b)
    for name in m:  # one task vector, alpha 1: the VLM LM
        torch.testing.assert_close(m[name], v[name], rtol=0, atol=2e-5)
    assert (out / RESULT_JSON).is_file() and (out / "tokenizer.json").is_file() and (out / "config.json").is_file()

    out2 = run_spectral_merge("tsv", trio["base"], trio["vlm"], tmp_path / "tsv2", root=trio["root"], progress=False)
    r, m2 = _w(trio["root"]), _w(out2)
    torch.testing.assert_close(m2[UP], r[UP] + tsv_merge([b[UP] - r[UP], v[UP] - r[UP]]), rtol=0, atol=1e-5)


def test_star_on_disk_and_selective(trio, tmp_path):
    from interventions.spectral import run_spectral_merge

    out = run_spectral_merge("star", trio["base"], trio["vlm"], tmp_path / "star", eta=40, progress=False)
    b, v, m = _w(trio["base"]), _w(trio["vlm"]), _w(out)
    for name in m:
        delta, merged = (v[name] - b[name]).double(), (m[name] - b[name]).double()
        if merged.ndim == 2:
            sv, sv_m = torch.linalg.svdvals(delta), torch.linalg.svdvals(merged)
            assert abs(sv_m.sum() - sv.sum()) / sv.sum() < 1e-4  # nuclear norm kept
            assert (sv_m > 1e-4 * sv_m[0]).sum() < (sv > 1e-4 * sv[0]).sum()  # rank cut
        else:
            torch.testing.assert_close(m[name], v[name], rtol=0, atol=1e-6)

    sel = run_spectral_merge("star", trio["base"], trio["vlm"], tmp_path / "sel", eta=40, select="mlp", progress=False)
    ms = load_file(str(sel / "model.safetensors"))
    for name in b:
        if ".mlp." in name:
            torch.testing.assert_close(ms[name], m[name], rtol=0, atol=1e-6)
        else:
            assert torch.equal(ms[name], b[name]), name


def test_bad_spectral_input_refused_before_work(trio, tmp_path):
    from interventions.merge import MergeError
    from interventions.spectral import run_spectral_merge

    with pytest.raises(MergeError, match="eta"):
        run_spectral_merge("star", trio["base"], trio["vlm"], tmp_path / "x", eta=0)
    with pytest.raises(MergeError, match="unknown spectral method"):
        run_spectral_merge("svd", trio["base"], trio["vlm"], tmp_path / "x")
    assert not (tmp_path / "x").exists()
