# Sourced by scripts/gpu_check.sh and scripts/gpu_check_adapt.sh. On the lent GPU machine (no network) the
# packages it lacks travel as wheels in .whl/ (scripts/gpu_wheels.sh, carried by the device tool): install
# them into /tmp/site without an index and without dependencies (so never torch: the machine's own torch
# and CUDA libraries stay), put them on PYTHONPATH after this checkout, and use the machine's python3.
# Without .whl/ nothing changes (the scripts make or reuse their own venv). GPU_SITE: another target (tests).
if compgen -G ".whl/*.whl" > /dev/null; then
    GPU_WHEELS=1
    GPU_SITE=${GPU_SITE:-/tmp/site}
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$GPU_SITE" .whl/*.whl \
        || { echo "installing .whl/ into $GPU_SITE failed (rebuild it with scripts/gpu_wheels.sh)" >&2; exit 2; }
    export PYTHONPATH="$PWD:$GPU_SITE${PYTHONPATH:+:$PYTHONPATH}"
    PYTHON=${PYTHON:-python3}
else
    GPU_WHEELS=0
fi
