#!/usr/bin/env bash
# The GPU figures of benchmarks/RESULTS.md in one run, on a machine with an NVIDIA GPU, from the
# repository alone: nothing is downloaded. It uses the machine's python3 with its torch (and triton,
# where installed) and builds k3kit's C extensions in place; Python packages k3kit needs that the
# machine lacks (gguf, fastapi, uvicorn, pydantic...) are installed from wheels in ./.whl when that
# folder exists (`pip download` them elsewhere for the machine's Python), never from the network.
#
#   bash benchmarks/gpu_check.sh            # writes $OUT (or out/gpu_check)/gpu_check.{md,json}
#   bash benchmarks/gpu_check.sh --sections mini,profile
#
# Arguments are passed to benchmarks/gpu_check.py (see its docstring for the sections).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
site=$(mktemp -d /tmp/k3kit-site.XXXXXX)
if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" .whl/*.whl \
    || { echo "gpu_check: installing the wheels in .whl failed" >&2; exit 2; }
fi
export PYTHONPATH="$PWD/src:$site${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
"$PY" setup.py -q build_ext --inplace >/tmp/k3kit-build.log 2>&1 \
  || echo "gpu_check: the C extensions did not build (torch fallbacks run); see /tmp/k3kit-build.log" >&2
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
exec "$PY" benchmarks/gpu_check.py "$@"
