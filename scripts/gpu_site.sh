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
    # The machine's own packages were trusted unread (gpu_wheels.sh prints what each must satisfy):
    # name every requirement of a carried wheel they miss, so a later import error has its cause above it.
    carried=$(for w in .whl/*.whl; do w=${w##*/}; echo "${w%%-*}"; done | tr 'A-Z_.' 'a-z--' | sort -u)
    { python3 -m pip check 2>/dev/null || true; } | while read -r dist rest; do  # (sourced under set -e -o pipefail)
        if grep -qx "$(echo "$dist" | tr 'A-Z_.' 'a-z--')" <<< "$carried"; then echo "gpu_site: $dist $rest" >&2; fi
    done
else
    GPU_WHEELS=0
fi
