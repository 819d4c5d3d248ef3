#!/usr/bin/env bash
# The device checks, in one script for a GPU machine with the project's runtime already
# installed (torch with CUDA, triton, pytest, hypothesis, xdist, transformers) and no network:
# installs the project without dependencies, then runs the GPU tests and the Triton kernels,
# certify on the device with CUDA graphs, the four graph mutants, the GPU bench and the
# profiler's account of a step. Everything is written under $WORK (default /tmp/gpu-check);
# $OUT (default ./gpu-out) gets the summary, the bench and profile JSON and one archive of
# $WORK (few files: what a device machine sends back is limited in count).
#
#   bash benchmarks/gpu_check.sh [quick|correctness|timings|full]
#
# quick: a few minutes (the tests, one spec's certify, one mutant, a short bench, the profile);
# correctness (about 6 minutes on an H200): every spec's certify beside the GPU tests, the
# Triton kernels and the four graph mutants; timings (about 6 minutes): the bench table at
# batch 1, 8 and 32 and the profile of a step (plain, EAGLE chain, MTP chain at the same batch
# sizes, with the host ops of a graphed step at batch 1), alone on the machine; full: both,
# one after the other (over 10 minutes: where one command may run 10 minutes at most, run
# correctness and timings as two). Each stage has its own time limit and a failed stage does
# not stop the next; the summary at the end lists each stage's exit status (docs/gpu.md); a
# mutant's stage passes when certify exits 1 (the check failed).
set -u
MODE=${1:-full}
OUT=${OUT:-$PWD/gpu-out}
WORK=${WORK:-/tmp/gpu-check}
mkdir -p "$OUT" "$WORK"
export PYTHONUNBUFFERED=1 PYTHONHASHSEED=0 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
PY=${PYTHON:-python3}
SUMMARY="$WORK/summary.txt"
: >"$SUMMARY"

stage() {  # stage NAME SECONDS COMMAND...: run with a limit, log to $WORK/NAME.log
  local name=$1 limit=$2
  shift 2
  local start=$SECONDS
  timeout --kill-after=10 "$limit" "$@" >"$WORK/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc $((SECONDS - start))s" | tee -a "$SUMMARY"
  tail -n 4 "$WORK/$name.log"
}

mutant() {  # mutant NAME SPEC CHECK: the check meant to kill it, on the device (rc=1: killed)
  stage "mutant-$1" 45 $PY -m conformance.cli certify --device cuda --graphs cuda \
    --backend "mutant:$1" --spec "$2" -k "$3" -n 4 --report "$WORK/mutant-$1"
}

{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  $PY -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'triton', triton.__version__, torch.cuda.get_device_name())"
} >"$WORK/env.log" 2>&1
cat "$WORK/env.log"

stage install 120 $PY -m pip install --no-deps --no-build-isolation -q -e .

correctness() {
  # certify on its workers; the tests, kernels and mutants on theirs, side by side.
  stage certify 330 $PY -m conformance.cli certify --device cuda --graphs cuda --spec all \
    -n 12 --case-timeout 120 --report "$WORK/cert" &
  (
    stage tests 150 $PY -m pytest -q -n 4 -m gpu tests/gpu --no-header -p no:cacheprovider \
      --timeout 90
    stage kernels 30 $PY -m pytest -q tests/test_tree_triton.py -p no:xdist -p no:cacheprovider
    mutant bonus_tokens_not_restaged mtp test_graph_matches_eager_at_every_size
    mutant stale_padded_rows none test_padded_rows_follow_the_policy
    mutant extend_padding_not_restaged eagle-tree test_acceptance_matches_golden
    mutant graph_walk_bonus_after_root eagle-tree test_greedy_matches_reference
    mutant step_root_not_restaged eagle test_greedy_matches_reference
  ) &
  wait
  tar -czf "$OUT/correctness.tgz" -C "$WORK" .  # in hand even if a later stage overruns
}

timings() {  # alone on the machine
  stage bench 270 $PY -m conformance.cli bench --device cuda --graphs cuda --spec mtp \
    --backends refengine,hf --batch-sizes 1,8,32 --min-requests 2 --max-new-tokens 32 \
    --json "$WORK/bench.json"
  stage profile 170 $PY benchmarks/gpu_profile.py --lanes plain,eagle-chain,mtp-chain \
    --batch-sizes 1,8,32 --tokens 64 --host-ops 15 --json "$WORK/profile.json"
  cat "$WORK/profile.log"
}

case "$MODE" in
  quick)
    stage tests 150 $PY -m pytest -q -n 8 -m gpu tests/gpu --no-header -p no:cacheprovider
    stage kernels 60 $PY -m pytest -q tests/test_tree_triton.py -p no:xdist -p no:cacheprovider
    stage certify 150 $PY -m conformance.cli certify --device cuda --graphs cuda \
      --spec eagle-tree -n 8 --report "$WORK/cert"
    mutant bonus_tokens_not_restaged mtp test_graph_matches_eager_at_every_size
    stage bench 120 $PY -m conformance.cli bench --device cuda --graphs cuda --spec eagle \
      --backends refengine,hf --batch-sizes 1 --json "$WORK/bench.json"
    stage profile 90 $PY benchmarks/gpu_profile.py --lanes plain,eagle-chain --tokens 64 \
      --json "$WORK/profile.json"
    ;;
  correctness) correctness ;;
  timings) timings ;;
  full) correctness; timings ;;
  *) echo "gpu_check.sh: error: mode must be quick, correctness, timings or full, got $MODE" >&2
     exit 2 ;;
esac
cp "$SUMMARY" "$OUT/"
cp "$WORK"/*.json "$OUT/" 2>/dev/null
tar -czf "$OUT/gpu-check.tgz" -C "$WORK" .
echo "== summary"
cat "$SUMMARY"
