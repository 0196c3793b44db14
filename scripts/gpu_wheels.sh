#!/usr/bin/env bash
# Wheels for a GPU machine without network access: build them here, where PyPI is reachable, copy
# them over with the checkout, and the GPU checks install them there with `pip install --no-index`.
#
#   scripts/gpu_wheels.sh [PACKAGES] [DEST]
#
# PACKAGES: what the GPU machine's python3 already has, written there with
#     { python3 -V; python3 -m pip list --format=freeze; } > gpu-packages.txt
# and copied here (default: scripts/gpu_packages.example.txt, a machine with Python 3.12, a CUDA
# torch 2.11 and transformers 5.17). DEST: where the wheels go (default .whl, ignored by git; emptied
# first, so it holds one version of each package).
#
# This resolves sinkstudy's dependencies for that Python on manylinux x86-64 (pip's resolver, metadata
# only), at the versions installed in this checkout's venv (what the tests pass with), and downloads
# into DEST the wheel of every package the machine lacks or holds in a version that does not satisfy
# them. Never torch and its CUDA libraries: the machine's own are used. A package with no wheel on
# PyPI is built here from its sdist, and only if it is pure Python (py3-none-any). A package listed
# without a version is taken as it is; the script prints what it must satisfy.
#
# Then, with the checkout and DEST copied to the GPU machine, run there
#     bash scripts/gpu_check.sh          # or scripts/gpu_check_adapt.sh
# Both install DEST first (scripts/gpu_site.sh):
#     python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
#     export PYTHONPATH=$PWD:/tmp/site
set -euo pipefail
cd "$(dirname "$0")/.."
PACKAGES=${1:-scripts/gpu_packages.example.txt}
DEST=${2:-.whl}
[ -f "$PACKAGES" ] || { echo "gpu_wheels: no package list $PACKAGES (write it on the GPU machine: see the top of this script)" >&2; exit 2; }
if [ -z "${PYTHON:-}" ]; then
    PYTHON=python3
    [ -x .venv/bin/python ] && PYTHON=.venv/bin/python
fi
export PIP_DISABLE_PIP_VERSION_CHECK=1
exec "$PYTHON" - "$PACKAGES" "$DEST" <<'EOF'
import atexit
import importlib.metadata as md
import json
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

PACKAGES, DEST = Path(sys.argv[1]), Path(sys.argv[2])


def read_packages(path: Path) -> tuple[str, dict[str, str | None]]:
    """(the machine's Python as X.Y, {package: version or None}) from `python3 -V` + `pip list --format=freeze` output."""
    python, found = None, {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"Python (\d+\.\d+)(\.\d+)?", line)
        if m:
            python = m.group(1)
            continue
        name, _, version = line.partition("==")
        found[canonicalize_name(name.split(" @ ")[0].strip())] = version.strip() or None
    if python is None:
        sys.exit(f"gpu_wheels: {path} does not say the machine's Python (its first line: the output of `python3 -V`)")
    return python, found


PYTHON_VERSION, THERE = read_packages(PACKAGES)
ABI = "cp" + PYTHON_VERSION.replace(".", "")
TARGET = ["--python-version", PYTHON_VERSION, "--implementation", "cp", "--abi", ABI, "--abi", "abi3", "--abi", "none",
          *[a for n in ("manylinux_2_28", "manylinux_2_27", "manylinux_2_17", "manylinux2014", "manylinux1")
            for a in ("--platform", f"{n}_x86_64")], "--only-binary=:all:"]
if "torch" not in THERE or THERE["torch"] is None:
    sys.exit(f"gpu_wheels: {PACKAGES} lists no torch version: install a CUDA torch on the GPU machine first")
NEVER = re.compile(r"^(torch|torchvision|torchaudio|triton|nvidia-.*|cuda-.*)$")  # the machine's CUDA stack stays


def pip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True)


project = tomllib.loads(Path("pyproject.toml").read_text())["project"]
requirements = project["dependencies"]
# Constraints: this venv's versions (what the tests pass with), torch at the machine's.
local = {canonicalize_name(d.metadata["Name"]): d.version.split("+")[0] for d in md.distributions()}
local.pop(canonicalize_name(project["name"]), None)
work = Path(tempfile.mkdtemp(prefix="gpu-wheels-"))
atexit.register(shutil.rmtree, work, True)  # also when it stops on an error
built = work / "built"  # pure-Python wheels built here from sdists
built.mkdir()


def stub_wheel(name: str, version: str) -> Path:
    """A wheel holding only `name`'s metadata, without requirements: the resolver takes the machine's
    torch as given instead of downloading ~1 GB of torch and CUDA wheels to read their metadata."""
    import zipfile

    path = work / "stubs" / f"{name}-{version}-py3-none-any.whl"
    path.parent.mkdir(exist_ok=True)
    info = f"{name}-{version}.dist-info"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: gpu_wheels\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    return path


constraints = {n: f"{n}=={v}" for n, v in local.items()}
constraints["torch"] = f"torch @ {stub_wheel('torch', THERE['torch'].split('+')[0]).as_uri()}"
(work / "constraints.txt").write_text("".join(f"{c}\n" for _, c in sorted(constraints.items())))
(work / "requirements.txt").write_text("".join(f"{r}\n" for r in requirements))

for attempt in range(20):
    # --target: pip refuses platform options without it (nothing is written: --dry-run)
    r = pip("install", "--dry-run", "--ignore-installed", "--target", str(work / "target"), "--report", str(work / "report.json"), *TARGET,
            "--find-links", str(built), "-c", str(work / "constraints.txt"), "-r", str(work / "requirements.txt"))
    if r.returncode == 0:
        break
    errors = "\n".join(line for line in (r.stdout + r.stderr).splitlines()
                       if not line.startswith(("WARNING: Location", "Collecting", "  Downloading", "Processing", "  Using")))
    # pip names a package without a usable distribution one of four ways (older pips: as a conflict)
    m = re.search(r"No matching distribution found for ([A-Za-z0-9_.\-]+)", errors) or \
        re.search(r"no matching distributions available for your environment:\n\s+([A-Za-z0-9_.\-]+)", errors) or \
        re.search(r"The user requested \(constraint\) ([A-Za-z0-9_.\-]+)==", errors) or \
        re.search(r"Cannot install ([A-Za-z0-9_.\-]+?)[<>=!~ ]", errors)
    name = canonicalize_name(m.group(1)) if m else None
    spec = f"{name}=={local[name]}" if name in local else name
    if name is None or pip("download", "--no-deps", "--quiet", *TARGET, "-d", str(work / "probe"), spec).returncode == 0:
        sys.exit(f"gpu_wheels: pip could not resolve the dependencies for python {PYTHON_VERSION}:\n{errors}")
    print(f"gpu_wheels: {spec} has no wheel for python {PYTHON_VERSION}; building it from its sdist", file=sys.stderr)
    w = pip("wheel", "--no-deps", "--quiet", "--no-binary", name, "-w", str(built), spec)
    wheels = sorted(built.glob(f"{name.replace('-', '_')}-*.whl"), key=lambda p: p.name.lower()) or \
        [p for p in built.glob("*.whl") if canonicalize_name(p.name.split("-")[0]) == name]
    if w.returncode != 0 or not wheels:
        sys.exit(f"gpu_wheels: cannot build {spec}: {(w.stderr.strip().splitlines() or ['?'])[-1]}")
    if not all(p.name.endswith("-none-any.whl") for p in wheels):
        sys.exit(f"gpu_wheels: {spec} has no python {PYTHON_VERSION} manylinux wheel and is not pure Python: {wheels[0].name}")
else:
    sys.exit("gpu_wheels: too many packages without wheels")

report = json.loads((work / "report.json").read_text())["install"]
env = default_environment() | {"python_version": PYTHON_VERSION, "python_full_version": f"{PYTHON_VERSION}.0", "sys_platform": "linux",
                               "platform_system": "Linux", "platform_machine": "x86_64", "implementation_name": "cpython"}
resolved = {canonicalize_name(i["metadata"]["name"]): i for i in report}
# Every requirement the resolved set puts on each package (for the machine's known versions).
needs: dict[str, SpecifierSet] = {}
for item in report:
    extras = set(item.get("requested_extras") or []) | {""}
    for text in item["metadata"].get("requires_dist") or []:
        req = Requirement(text)
        if req.marker is None or any(req.marker.evaluate(env | {"extra": e}) for e in extras):
            name = canonicalize_name(req.name)
            needs[name] = needs.get(name, SpecifierSet()) & req.specifier
for text in requirements:
    req = Requirement(text)
    needs[canonicalize_name(req.name)] = needs.get(canonicalize_name(req.name), SpecifierSet()) & req.specifier

install, kept = [], []
for name, item in sorted(resolved.items()):
    version = item["metadata"]["version"]
    there = THERE.get(name)
    if NEVER.match(name):
        kept.append(f"{name} (the machine's {there or 'own'})")
    elif name in THERE and (there is None or Version(there.split("+")[0]) in needs.get(name, SpecifierSet())):
        # listed without a version: taken as it is; say what it must satisfy, for when an import fails there
        unchecked = f"; must be {needs[name]}" if there is None and str(needs.get(name, "")) else ""
        kept.append(f"{name} (the machine's {there or 'own'}{unchecked})")
    elif name in THERE:
        install.append((name, version, f"the machine has {there}, needs {needs[name]}"))
    else:
        install.append((name, version, "missing there"))

if DEST.exists():
    shutil.rmtree(DEST)
DEST.mkdir(parents=True)
local_wheels = {canonicalize_name(p.name.split("-")[0]): p for p in built.glob("*.whl")}
to_download = [f"{n}=={v}" for n, v, _ in install if n not in local_wheels]
if to_download:
    r = pip("download", "--no-deps", "--quiet", *TARGET, "-d", str(DEST), *to_download)
    if r.returncode != 0:
        sys.exit(f"gpu_wheels: download failed:\n{r.stderr.strip()}")
for n, _, _ in install:
    if n in local_wheels:
        shutil.copy2(local_wheels[n], DEST / local_wheels[n].name)

names = [canonicalize_name(p.name.split("-")[0]) for p in DEST.glob("*.whl")]
assert len(names) == len(set(names)) == len(install), "one wheel per package to install"
total = sum(p.stat().st_size for p in DEST.glob("*.whl"))
for n, v, why in install:
    print(f"wheel  {n}=={v}  ({why})")
print(f"kept on the machine: {', '.join(kept)}")
print(f"{len(install)} wheels, {total / 2**20:.1f} MiB in {DEST}: copy it to the GPU machine with the checkout")
EOF
