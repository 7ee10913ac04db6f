#!/usr/bin/env bash
# Mutation testing of the estimators' references and the replicate metrics (issue #13). Not part of CI.
#
# mutmut 3 reads [tool.mutmut] in pyproject.toml (files to mutate, the fast test subset) and copies the
# tree into ./mutants (git-ignored). A full run of the configured files takes ~1 h on 2 busy cores;
# pass a time box in seconds (default 1500) and, optionally, mutant-name globs to rerun only those, e.g.
#   benchmarks/mutation.sh 600 'randattn.estimators.ra.reference.*'
# Results: `mutmut results` (survivors), `mutmut show <name>` (the diff of one mutant).
# Score = (killed + timeout) / (all checked mutants); "not checked" ones ran out of the time box.
set -euo pipefail
cd "$(dirname "$0")/.."
budget="${1:-1500}"
shift || true
# PYTHONPATH would shadow the mutated copy in ./mutants with this checkout: unset it
env -u PYTHONPATH timeout "$budget" mutmut run --max-children "${MUTMUT_CHILDREN:-2}" "$@" || true
env -u PYTHONPATH mutmut results 2>/dev/null | awk -F': ' '{print $2}' | sort | uniq -c
