#!/usr/bin/env bash
# The test suite against another torch release, in a throwaway virtual environment (docs/maintaining.rst,
# "Other torch releases"):
#
#     tools/other_torch/run.sh 2.1.2                 # the whole suite
#     tools/other_torch/run.sh 2.14.1 tests/internal # or the paths (and pytest options) given after the version
#
# The venv is $OTHER_TORCH_VENV, else /tmp/fairscale-torch-VERSION (kept for the next run). PyPI's Linux wheels of
# torch are CUDA builds (several GB with their nvidia-* dependencies); they run on the CPU as well. torch < 2.4 was
# built against NumPy 1: numpy<2 is installed beside it.
set -euo pipefail
if [ $# -lt 1 ]; then
    echo "usage: $0 TORCH_VERSION [pytest arguments]" >&2
    exit 2
fi
version="$1"
shift
root="$(cd "$(dirname "$0")/../.." && pwd)"
venv="${OTHER_TORCH_VENV:-/tmp/fairscale-torch-$version}"
python="${PYTHON:-python3}"
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
numpy="numpy"
case "$version" in 2.1.* | 2.2.* | 2.3.*) numpy="numpy<2" ;; esac
"$venv/bin/pip" install -q "torch==$version" "$numpy"
"$venv/bin/pip" install -q -e "$root[dev]"
"$venv/bin/python" -c 'import torch; print(f"torch {torch.__version__}")'
cd "$root"
if [ $# -eq 0 ]; then
    set -- tests
fi
exec "$venv/bin/python" -m pytest -q -p no:cacheprovider -rfEs --continue-on-collection-errors "$@"
