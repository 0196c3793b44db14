"""The GPU checks' offline set-up for the lent GPU machine (no network): wheels carried in .whl/
(scripts/gpu_wheels.sh, run where PyPI is reachable) are installed by scripts/gpu_site.sh without an
index into a site folder that goes on PYTHONPATH for the machine's python3; without .whl/ nothing
changes. Run on copies of the scripts in a temporary checkout, with `python3` = this interpreter."""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _wheel(dest: Path, name: str = "gpu_site_probe", version: str = "1.0", requires: str = "") -> Path:
    """A minimal pure-Python wheel holding module `name` (VALUE = 42)."""
    dest.mkdir(parents=True, exist_ok=True)
    path = dest / f"{name}-{version}-py3-none-any.whl"
    info = f"{name}-{version}.dist-info"
    needs = f"Requires-Dist: {requires}\n" if requires else ""
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{name}.py", "VALUE = 42\n")
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n{needs}")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    return path


def _checkout(tmp_path: Path, wheels: bool) -> tuple[Path, dict]:
    """A checkout with the GPU scripts, optionally .whl/, and an environment whose python3 is this
    interpreter (as the machine's python3 holds torch) and nothing on PYTHONPATH."""
    root = tmp_path / "checkout"
    (root / "scripts").mkdir(parents=True)
    for script in ("gpu_site.sh", "gpu_check_adapt.sh"):
        shutil.copy2(ROOT / "scripts" / script, root / "scripts" / script)
    if wheels:
        _wheel(root / ".whl")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')  # a venv python stays one
    (bin_dir / "python3").chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path), "GPU_SITE": str(tmp_path / "site"),
           "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    return root, env


def _source_site(root: Path, env: dict) -> list[str]:
    script = ('source scripts/gpu_site.sh; echo "$GPU_WHEELS|${PYTHON:-}|${PYTHONPATH:-}"; '
              'python3 -c "import gpu_site_probe; print(gpu_site_probe.VALUE)" 2>/dev/null || echo missing')
    r = subprocess.run(["bash", "-c", script], cwd=root, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout.split()


def test_wheels_are_installed_without_an_index_and_put_on_the_path(tmp_path):
    root, env = _checkout(tmp_path, wheels=True)
    flags, probe = _source_site(root, env)
    assert flags == f"1|python3|{root}:{tmp_path / 'site'}"
    assert probe == "42"  # importable by the machine's python3 through the PYTHONPATH gpu_site.sh exports
    assert (tmp_path / "site" / "gpu_site_probe.py").is_file()


def test_a_requirement_the_machine_misses_is_named(tmp_path):
    """A carried wheel's requirement that the machine's packages do not meet is named before any
    check runs (gpu_wheels.sh trusts versions it could not read there)."""
    root, env = _checkout(tmp_path, wheels=True)
    _wheel(root / ".whl", "gpu_site_needy", requires="no-such-dist-xyz>=1")
    # as the scripts source it: under set -euo pipefail, where pip check's exit status 1 must not stop them
    r = subprocess.run(["bash", "-c", "set -euo pipefail; source scripts/gpu_site.sh; echo sourced"], cwd=root,
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.split() == ["sourced"], r.stderr
    named = [line for line in r.stderr.splitlines() if line.startswith("gpu_site: ")]
    assert named == ["gpu_site: gpu-site-needy 1.0 requires no-such-dist-xyz, which is not installed."], r.stderr


def test_without_wheels_nothing_changes(tmp_path):
    root, env = _checkout(tmp_path, wheels=False)
    assert _source_site(root, env) == ["0||", "missing"]
    assert not (tmp_path / "site").exists()


def test_a_broken_wheel_stops_the_check_in_one_line(tmp_path):
    root, env = _checkout(tmp_path, wheels=False)
    (root / ".whl").mkdir()
    (root / ".whl" / "broken-1.0-py3-none-any.whl").write_bytes(b"not a zip")
    r = subprocess.run(["bash", "scripts/gpu_check_adapt.sh"], cwd=root, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1] == \
        f"installing .whl/ into {tmp_path / 'site'} failed (rebuild it with scripts/gpu_wheels.sh)"


def test_adapt_check_with_wheels_refuses_instead_of_reaching_for_pypi(tmp_path):
    """With .whl/ the machine has no network: a python that cannot run the check (here: no CUDA) is
    named in one line, and no venv is made nor pip install tried."""
    root, env = _checkout(tmp_path, wheels=True)
    r = subprocess.run(["bash", "scripts/gpu_check_adapt.sh"], cwd=root, env=env, capture_output=True, text=True,
                       timeout=300)
    if r.returncode == 0:
        import pytest

        pytest.skip("this machine has CUDA: run the script itself")
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu_check_adapt: python3 with .whl/ cannot run the check: ")
    assert not (root / ".venv-gpu").exists()
