# Sourced by scripts/gpu_check.sh and scripts/gpu_check_adapt.sh. On a GPU machine without network, the
# packages it lacks come as wheels in .whl/ (built where PyPI is reachable by scripts/gpu_wheels.sh and
# copied over with the checkout): install them into /tmp/site without an index and without dependencies
# (so never torch: the machine's own torch and CUDA libraries stay), put them on PYTHONPATH after this
# checkout, and use the machine's python3. Without .whl/ nothing changes (the scripts make or reuse their
# own venv). GPU_SITE: another target (tests).
if compgen -G ".whl/*.whl" > /dev/null; then
    GPU_WHEELS=1
    GPU_SITE=${GPU_SITE:-/tmp/site}
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$GPU_SITE" .whl/*.whl \
        || { echo "installing .whl/ into $GPU_SITE failed (rebuild it with scripts/gpu_wheels.sh)" >&2; exit 2; }
    export PYTHONPATH="$PWD:$GPU_SITE${PYTHONPATH:+:$PYTHONPATH}"
    PYTHON=${PYTHON:-python3}
    # Packages listed without a version were taken as they are (gpu_wheels.sh prints what each must satisfy):
    # name every requirement of an installed wheel they miss, so a later import error has its cause above it.
    wheels=$(for w in .whl/*.whl; do w=${w##*/}; echo "${w%%-*}"; done | tr 'A-Z_.' 'a-z--' | sort -u)
    { python3 -m pip check 2>/dev/null || true; } | while read -r dist rest; do  # (sourced under set -e -o pipefail)
        if grep -qx "$(echo "$dist" | tr 'A-Z_.' 'a-z--')" <<< "$wheels"; then echo "gpu_site: $dist $rest" >&2; fi
    done
else
    GPU_WHEELS=0
fi
