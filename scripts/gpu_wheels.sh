#!/usr/bin/env bash
# Wheels for the lent GPU machine, which has no network (/work/.library/device/README.md, KINDS.md).
#
#   scripts/gpu_wheels.sh [DEST]          (default DEST: .whl, git-ignored; run HERE, where PyPI is reachable)
#
# Its python3 (3.12) has torch 2.11 + CUDA and many packages, but not mergekit, lm-eval, datasets, nltk,
# langdetect, immutabledict, ... and its transformers (5.17) is older than sinkstudy needs (>= 5.23, see
# pyproject.toml). This resolves sinkstudy's dependencies for CPython 3.12 on
# manylinux x86-64 (pip's resolver, metadata only), at the versions installed in this checkout's venv
# (what the tests pass with), and downloads into DEST the wheel of every package the machine lacks or
# holds in a version that does not satisfy the resolved requirements. Never torch and its CUDA
# libraries (the machine's own are used). A package with no wheel on PyPI is built here from its
# sdist, and only if it is pure Python (py3-none-any). DEST is emptied first: one version of each.
#
# On the machine, scripts/gpu_check.sh and scripts/gpu_check_adapt.sh install DEST themselves:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
#   export PYTHONPATH=$PWD:/tmp/site
# The device-tool calls, one per script (docs/adapt.md, "On the lent GPU machine"):
#   run(command="bash scripts/gpu_check.sh /tmp/gpu_check", carry=[".whl"], timeout_s=600)
#   run(command="bash scripts/gpu_check_adapt.sh", carry=[".whl"], timeout_s=600)
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${1:-.whl}
if [ -z "${PYTHON:-}" ]; then
    PYTHON=python3
    [ -x .venv/bin/python ] && PYTHON=.venv/bin/python
fi
export PIP_DISABLE_PIP_VERSION_CHECK=1
exec "$PYTHON" - "$DEST" <<'EOF'
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

DEST = Path(sys.argv[1])
TARGET = ["--python-version", "3.12", "--implementation", "cp", "--abi", "cp312", "--abi", "abi3", "--abi", "none",
          *[a for n in ("manylinux_2_28", "manylinux_2_27", "manylinux_2_17", "manylinux2014", "manylinux1")
            for a in ("--platform", f"{n}_x86_64")], "--only-binary=:all:"]
# The machine's python3: versions read there (KINDS.md, 2026-11), then every other package it holds.
DEVICE_VERSIONS = {"accelerate": "1.15.0", "huggingface-hub": "1.33.0", "numpy": "2.5.2", "safetensors": "0.8.0",
                   "tokenizers": "0.23.2", "torch": "2.11.0", "transformers": "5.17.0", "triton": "3.6.0",
                   "torchvision": "0.26.0", "sentencepiece": "0.2.2", "tiktoken": "0.14.0"}
DEVICE_PACKAGES = set(DEVICE_VERSIONS) | set("""
absl-py aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi charset-normalizer
chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core cuda-pathfinder cuda-toolkit
cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools formulaic
frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx humanize hypothesis idna imageio iniconfig
interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning
lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl meson
ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals networkx ninja numba
numba-cuda numpyro nvidia-ml-py onnx onnx-ir onnxruntime onnxscript opencv-python-headless optax opt-einsum
opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker
prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks
pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil
pytorch-lightning pyyaml regex requests rich sacrebleu scikit-build-core scikit-image scikit-learn scipy seaborn
sentence-transformers setuptools shellingham simplejson six sortedcontainers statsmodels sympy tabulate tensorboard
tensorboard-data-server tensorstore threadpoolctl tifffile timm toolz torchaudio torchdiffeq torch-geometric
torchmetrics tqdm treescope typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt
xarray xxhash yarl zipp""".split())  # nvidia-* / cuda-* libraries: NEVER below
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
constraints["torch"] = f"torch @ {stub_wheel('torch', DEVICE_VERSIONS['torch']).as_uri()}"
(work / "constraints.txt").write_text("".join(f"{c}\n" for _, c in sorted(constraints.items())))
(work / "requirements.txt").write_text("".join(f"{r}\n" for r in requirements))

for attempt in range(20):
    r = pip("install", "--dry-run", "--ignore-installed", "--report", str(work / "report.json"), *TARGET,
            "--find-links", str(built), "-c", str(work / "constraints.txt"), "-r", str(work / "requirements.txt"))
    if r.returncode == 0:
        break
    errors = "\n".join(line for line in (r.stdout + r.stderr).splitlines()
                       if not line.startswith(("WARNING: Location", "Collecting", "  Downloading", "Processing", "  Using")))
    # pip names a package without a usable distribution one of two ways
    m = re.search(r"No matching distribution found for ([A-Za-z0-9_.\-]+)", errors) or \
        re.search(r"no matching distributions available for your environment:\n\s+([A-Za-z0-9_.\-]+)", errors)
    name = canonicalize_name(m.group(1)) if m else None
    spec = f"{name}=={local[name]}" if name in local else name
    if name is None or pip("download", "--no-deps", "--quiet", *TARGET, "-d", str(work / "probe"), spec).returncode == 0:
        sys.exit(f"gpu_wheels: pip could not resolve the dependencies for python 3.12:\n{errors}")
    print(f"gpu_wheels: {spec} has no wheel for python 3.12; building it from its sdist", file=sys.stderr)
    w = pip("wheel", "--no-deps", "--quiet", "--no-binary", name, "-w", str(built), spec)
    wheels = sorted(built.glob(f"{name.replace('-', '_')}-*.whl"), key=lambda p: p.name.lower()) or \
        [p for p in built.glob("*.whl") if canonicalize_name(p.name.split("-")[0]) == name]
    if w.returncode != 0 or not wheels:
        sys.exit(f"gpu_wheels: cannot build {spec}: {(w.stderr.strip().splitlines() or ['?'])[-1]}")
    if not all(p.name.endswith("-none-any.whl") for p in wheels):
        sys.exit(f"gpu_wheels: {spec} has no python 3.12 manylinux wheel and is not pure Python: {wheels[0].name}")
else:
    sys.exit("gpu_wheels: too many packages without wheels")

report = json.loads((work / "report.json").read_text())["install"]
env = default_environment() | {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
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

carry, kept = [], []
for name, item in sorted(resolved.items()):
    version = item["metadata"]["version"]
    there = DEVICE_VERSIONS.get(name)
    if NEVER.match(name):
        kept.append(f"{name} (the machine's {there or 'own'})")
    elif name in DEVICE_PACKAGES and (there is None or Version(there) in needs.get(name, SpecifierSet())):
        # a version not read there is trusted: say what it must satisfy, for when an import fails there
        unchecked = f"; must be {needs[name]}" if there is None and str(needs.get(name, "")) else ""
        kept.append(f"{name} (the machine's {there or 'own'}{unchecked})")
    elif name in DEVICE_PACKAGES:
        carry.append((name, version, f"the machine has {there}, needs {needs[name]}"))
    else:
        carry.append((name, version, "missing there"))

if DEST.exists():
    shutil.rmtree(DEST)
DEST.mkdir(parents=True)
local_wheels = {canonicalize_name(p.name.split("-")[0]): p for p in built.glob("*.whl")}
to_download = [f"{n}=={v}" for n, v, _ in carry if n not in local_wheels]
if to_download:
    r = pip("download", "--no-deps", "--quiet", *TARGET, "-d", str(DEST), *to_download)
    if r.returncode != 0:
        sys.exit(f"gpu_wheels: download failed:\n{r.stderr.strip()}")
for n, _, _ in carry:
    if n in local_wheels:
        shutil.copy2(local_wheels[n], DEST / local_wheels[n].name)

names = [canonicalize_name(p.name.split("-")[0]) for p in DEST.glob("*.whl")]
assert len(names) == len(set(names)) == len(carry), "one wheel per carried package"
total = sum(p.stat().st_size for p in DEST.glob("*.whl"))
for n, v, why in carry:
    print(f"carry  {n}=={v}  ({why})")
print(f"kept on the machine: {', '.join(kept)}")
print(f"{len(carry)} wheels, {total / 2**20:.1f} MiB in {DEST} (the device tool carries at most 64 MiB with the tree)")
if total > 48 * 2**20:
    sys.exit("gpu_wheels: over 48 MiB: the working tree and the wheels may not fit one call")
EOF
