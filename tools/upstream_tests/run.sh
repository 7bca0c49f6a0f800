#!/usr/bin/env bash
# Runs upstream fairscale's own tests, unmodified, against this checkout and prints a count per test file.
#
#   tools/upstream_tests/run.sh UPSTREAM_CHECKOUT [TARGET...]
#
# UPSTREAM_CHECKOUT is a checkout of upstream fairscale (only its tests/ is used). TARGETs are paths under it; the
# default is the Pipe family (the multi-process AsyncPipe tests, the single-process Pipe tests, AMPnet and the RPC
# DistributedPipeline) and the CPU-runnable OSS, AdaScale, ShardedDDP, model-parallel, MoE, wrap, checkpoint,
# FlattenParamsWrapper, utils and experimental tests that need no extra packages (docs/maintaining.rst). Each target
# runs in its own pytest process, one after the other (the multi-process tests start several ranks each).
# Environment: PYTHON (the interpreter, default python3) and UPSTREAM_TESTS_TIMEOUT (seconds per target, default 900).
#
# Exit status: 0 when every failure is an explained environment limit (listed at the end of the summary), 1 when a
# test failed for another reason or a target could not run (missing, timed out, crashed, collected nothing).
set -euo pipefail

repo="$(cd "$(dirname "$0")/../.." && pwd)"
python_bin="${PYTHON:-python3}"
timeout_s="${UPSTREAM_TESTS_TIMEOUT:-900}"

if [ "$#" -lt 1 ] || [ ! -d "$1/tests" ]; then
    echo "usage: $0 UPSTREAM_CHECKOUT [TARGET...]  (UPSTREAM_CHECKOUT must contain tests/)" >&2
    exit 2
fi
upstream="$(cd "$1" && pwd)"
shift
if [ "$#" -gt 0 ]; then
    targets=("$@")
else
    targets=(
        tests/nn/pipe_process
        tests/nn/pipe
        tests/experimental/nn/ampnet_pipe_process
        tests/experimental/nn/test_multiprocess_pipe.py
        tests/optim/test_oss.py
        tests/optim/test_single_node_adascale.py
        tests/nn/data_parallel/test_sharded_ddp_features.py
        tests/nn/model_parallel/test_initialize.py
        tests/nn/moe/test_top2gating.py
        tests/nn/wrap/test_wrap.py
        tests/nn/checkpoint/test_checkpoint_activations.py
        tests/nn/misc
        tests/utils/test_containers.py
        tests/utils/test_state_dict.py
        tests/utils/test_version.py
        tests/experimental/optim/test_dynamic_loss_scaler.py
        tests/experimental/nn/test_auto_shard.py
    )
fi

# The tests run from a copy of upstream's tests/: run in place, pytest would put the checkout's root on sys.path and
# upstream's own fairscale/ would shadow this one. PYTHONPATH puts this checkout first, installed or not.
work="$(mktemp -d -t fairscale-upstream-tests-XXXXXX)"
trap 'rm -rf "$work"' EXIT
cp -R "$upstream/tests" "$work/tests"
mkdir "$work/results"
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"

imported="$(cd "$work" && "$python_bin" -c 'import fairscale; print(fairscale.__file__)')"
case "$imported" in
    "$repo"/fairscale/*) echo "fairscale under test: $imported" ;;
    *) echo "error: 'import fairscale' resolves to $imported, not to this checkout ($repo)" >&2; exit 1 ;;
esac

: > "$work/results/status"
index=0
for target in "${targets[@]}"; do
    index=$((index + 1))
    if [ ! -e "$work/$target" ]; then
        echo "=== $target: not in $upstream"
        echo "$target missing" >> "$work/results/status"
        continue
    fi
    echo "=== $target"
    rc=0
    # xunit1 records each test's file, which the summary groups by; -rfEsx lists why tests failed or skipped.
    (cd "$work" && timeout "$timeout_s" "$python_bin" -m pytest "$target" -p no:cacheprovider -q -rfEsx \
        -o junit_family=xunit1 --junitxml="$work/results/$index.xml") || rc=$?
    case "$rc" in
        0 | 1) ;;  # 1: some tests failed, which the summary counts and explains
        124) echo "$target timed out after ${timeout_s} s" >> "$work/results/status" ;;
        *) echo "$target pytest exit status $rc" >> "$work/results/status" ;;
    esac
done

"$python_bin" - "$work/results" <<'PY'
"""Counts per upstream test file from the JUnit reports, and which failures are known environment limits."""
import collections
import glob
import os
import sys
import xml.etree.ElementTree as ET

# Failures that are not this distribution's: (text in the failure message, why). Upstream fails them the same way.
ENVIRONMENT = [
    (
        "exceptions must be derived from Warning, not <class 'NoneType'>",
        "pytest>=8 removed pytest.warns(None), which the test calls; it passes under pytest 7",
    ),
    (
        "'NoneType' object has no attribute 'numpy'",
        "torch>=2 Optimizer.zero_grad() sets gradients to None by default, and upstream's AdaScale.zero_grad() calls"
        " it without arguments, so test_single_node_adascale.py::test_gradient_value reads a None gradient there too",
    ),
]

results = sys.argv[1]
counts = collections.defaultdict(collections.Counter)
explained, unexplained = [], []
for report in sorted(glob.glob(os.path.join(results, "*.xml"))):
    for case in ET.parse(report).iter("testcase"):
        path = case.get("file") or case.get("classname", "?")
        node = f"{path}::{case.get('name')}"
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed"
                message = child.get("message") or ""
                reason = next((why for text, why in ENVIRONMENT if text in message), None)
                (explained if reason else unexplained).append((node, reason or message.splitlines()[0][:160]))
            elif child.tag == "skipped":
                outcome = "xfailed" if child.get("type") == "pytest.xfail" else "skipped"
        counts[path][outcome] += 1

columns = ("passed", "failed", "skipped", "xfailed")
width = max([len(p) for p in counts] + [len("total")])
print("\n" + "file".ljust(width) + "".join(c.rjust(9) for c in columns))
for path in sorted(counts):
    print(path.ljust(width) + "".join(str(counts[path][c]).rjust(9) for c in columns))
total = sum(counts.values(), collections.Counter())
print("total".ljust(width) + "".join(str(total[c]).rjust(9) for c in columns))

for title, entries in (("environment limits (not counted against this checkout)", explained), ("FAILED", unexplained)):
    if entries:
        print(f"\n{title}:")
        for node, reason in entries:
            print(f"  {node}: {reason}")
with open(os.path.join(results, "status")) as f:
    problems = [line.strip() for line in f if line.strip()]
for problem in problems:
    print(f"\nTARGET NOT RUN: {problem}")
sys.exit(1 if unexplained or problems else 0)
PY
