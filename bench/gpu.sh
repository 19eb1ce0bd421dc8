#!/usr/bin/env bash
# The GPU speed measurements on one H100 or H200, offline, in about 5 minutes (DIFFEXP_GPU_BUDGET_S, default 300):
#   bash bench/gpu.sh OUT_DIR
# run from the repository root. Steps, most valuable first; each runs within its cap and what is left of the budget,
# and a step that fails or runs out of time is noted in failed.txt while the others still run:
#  1. kernels-check: the kernels the door picks on CUDA against the fp32 plain path (output and every gradient), in
#     a compiled block too, and the decoding step's CUDA graph (tests/test_gpu.py, tests/test_decoding.py);
#  2. train-compiled-<variant>: each variant against the baseline at the 125m recipe's own shape (32K vocab, seq
#     2048, micro-batch 8), bf16, compiled as the recipes train; one process per variant, so one slow compile
#     loses one row; the four differential variants first, then the softmax-constraint study's two;
#  3. fit: a short real `diffexp fit` of the 125m DIFF V1 recipe at that shape (MQAR tokens over the 32K
#     vocabulary, made in memory: no download), compiled as the recipe says: what the trainer adds to the bench
#     step of that model;
#  4. probe (which SDPA backends take the recipe's attention calls, each formulation's cost) and train-eager.
# OUT_DIR holds four files, each replaced whole whenever it changes, so a copy taken at any moment, or a run
# stopped from outside, has everything measured until then:
#   gpu.log      all output;              failed.txt   the steps that failed or ran out of time;
#   summary.md   every table so far;      results.tar  every results JSON and plot so far (tar -xf results.tar).
# Results are written as they are measured (bench train after each round), and gathered into OUT_DIR every few
# seconds. Scratch (run directories) goes to $DIFFEXP_GPU_WORK (default: a new /tmp/diffexp-gpu-* directory).
# Packages the GPU image lacks are installed from wheels in .whl/ (docs/gpu.md).
# DIFFEXP_GPU_SH_SMOKE=1 runs the same steps on the CPU at a tiny size from DIFFEXP_GPU_RECIPE_DIR (tests do).
set -uo pipefail
out=${1:?usage: bash bench/gpu.sh OUT_DIR}
mkdir -p "$out" || exit 2
out=$(cd "$out" && pwd)
work=${DIFFEXP_GPU_WORK:-$(mktemp -d /tmp/diffexp-gpu-XXXXXX)}
mkdir -p "$work/results"
: >"$out/failed.txt"
exec > >(tee -a "$out/gpu.log") 2>&1

# Settings (environment): DIFFEXP_GPU_BUDGET_S the whole script's seconds (each step gets at most what is left);
# DIFFEXP_GPU_CAP_PERCENT every step's cap, in percent of the caps below; DIFFEXP_GPU_SIZE the recipe size;
# DIFFEXP_GPU_VARIANTS the variants measured against the baseline; DIFFEXP_GPU_ROUNDS bench train's rounds;
# DIFFEXP_GPU_COMPILE=0 the "compiled" steps eager; DIFFEXP_GPU_STEPS the steps to run (default: all, in order:
# kernels-check train-compiled fit probe train-eager), e.g. only those to measure again after a fix.
budget=${DIFFEXP_GPU_BUDGET_S:-300}
size=${DIFFEXP_GPU_SIZE:-125m}
recipes=${DIFFEXP_GPU_RECIPE_DIR:-recipes/gpu}
variants=(${DIFFEXP_GPU_VARIANTS:-diff_v1 dint diff_v2 shared_diff softmax_sink gated})
device=cuda dtype=bf16 rounds=2 steps=3 fit_steps=30 seq=() fit_rows=8 fit_seq=2048 fit_pairs=64 fit_extra=()
probe_extra=() percent=100
if [ "${DIFFEXP_GPU_SH_SMOKE:-0}" = 1 ]; then  # inductor's CPU compiles take minutes on a small machine
  device=cpu dtype=fp32 rounds=1 steps=1 fit_steps=4 seq=(--seq-lens 32 --batch-size 1) fit_rows=1 fit_seq=32 fit_pairs=4
  fit_extra=(--trainer.accelerator cpu --trainer.devices 1 --model.compile false) probe_extra=(--seq-len 32 --batch-size 1)
  percent=600 budget=${DIFFEXP_GPU_BUDGET_S:-3600}
fi
percent=${DIFFEXP_GPU_CAP_PERCENT:-$percent} rounds=${DIFFEXP_GPU_ROUNDS:-$rounds}
compile=(--compile); [ "${DIFFEXP_GPU_COMPILE:-1}" = 0 ] && compile=()
wanted=" ${DIFFEXP_GPU_STEPS:-kernels-check train-compiled fit probe train-eager} "

# Packages the image lacks, from wheels carried in .whl/ (installed once, outside the image's environment)
if [ -d .whl ] && ! python3 -c "import jsonargparse, docstring_parser, typeshed_client" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
dx=(python3 -m diffexp)
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'device',
torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'cpu')"
git log -1 --format='commit %h %s' 2>/dev/null || true

gather() {  # every results file so far into OUT_DIR/results.tar, replaced whole (never a half-written archive)
  local partial="$out/.results.tar.$BASHPID"
  (cd "$work/results" && tar -cf "$partial" -- * 2>/dev/null) && mv -f "$partial" "$out/results.tar"
  rm -f "$partial"
}
summarise() {  # every table so far into OUT_DIR/summary.md, replaced whole
  python3 -m diffexp.bench.summary "$work/results" "$out/summary.md" >/dev/null 2>&1 || true
}
rm -f "$work/.stop"
( n=0; while [ ! -e "$work/.stop" ]; do sleep 1; n=$((n + 1)); [ $((n % 5)) = 0 ] && gather; done ) &
gatherer=$!  # every 5 s: a run stopped from outside keeps what was measured up to then
trap 'touch "$work/.stop"; wait $gatherer; gather; summarise' EXIT

reserve=0  # seconds a step leaves for the steps after it that must run (the fit)
step() {  # step NAME CAP_SECONDS COMMAND...: runs it within min(CAP, what is left - reserve); a failure is noted
  local name=$1 cap=$(($2 * percent / 100)); shift 2
  local kind=$name; [[ $name == train-compiled-* ]] && kind=train-compiled
  [[ $wanted == *" $kind "* ]] || return 0
  local left=$((budget - SECONDS - reserve)); local limit=$((cap < left ? cap : left))
  if [ "$limit" -lt 10 ]; then echo "$name: skipped, the ${budget} s budget is spent" | tee -a "$out/failed.txt"; return; fi
  echo "=== $name (at ${SECONDS} s, limit ${limit} s): $*"
  timeout --signal=INT --kill-after=10 "$limit" "$@"
  local rc=$?
  if [ $rc -ne 0 ]; then
    echo "$name: exit $rc$([ $rc -eq 124 ] && echo ", stopped at its ${limit} s limit")" | tee -a "$out/failed.txt"
  fi
  gather; summarise
}

common=(--recipe "$size" --recipe-dir "$recipes" --device "$device" --dtype "$dtype" --backend sdpa
        --rounds "$rounds" --steps "$steps" --warmup 1 "${seq[@]}")
if [ "$device" = cuda ]; then
  step kernels-check 90 python3 -m pytest -v -p no:cacheprovider tests/test_gpu.py tests/test_decoding.py \
    -k "kernels_picked or (cuda_graph and (diff_v1 or dint))"  # -v: a check stopped at its cap names what passed
fi
case $wanted in *" fit "*) reserve=$((70 * percent / 100)) ;; esac
for v in "${variants[@]}"; do
  step "train-compiled-$v" 70 "${dx[@]}" bench train "${common[@]}" "${compile[@]}" --variants baseline "$v" --profile 8 \
    --json "$work/results/train-compiled-$v.json"
done
reserve=0
fit_dir="$work/fit-$(date +%Y%m%d-%H%M%S)"
fit=("${dx[@]}" fit --config "$recipes/base.yaml" --config "$recipes/size/$size.yaml"
     --config "$recipes/variant/diff_v1.yaml" --data diffexp.data.mqar.MQARDataModule --data.vocab_size 32768
     --data.num_kv_pairs "$fit_pairs" --data.seq_len "$fit_seq" --data.batch_size "$fit_rows" --data.num_workers 4
     --global_batch.rows "$fit_rows" --trainer.max_steps "$fit_steps" --trainer.val_check_interval "$fit_steps"
     --trainer.limit_val_batches 0 --trainer.log_every_n_steps 3 --checkpoint.every_n_train_steps 0
     --trainer.logger.init_args.save_dir "$fit_dir" "${fit_extra[@]}")
step fit 70 "${fit[@]}"
if [ -d "$fit_dir" ]; then
  python3 -m diffexp.bench.summary fit "$fit_dir" "$work/results/fit.json" diff_v1 "${fit[@]:2}" \
    || echo "fit: no tokens/s read from its logs" | tee -a "$out/failed.txt"
fi
step probe 30 "${dx[@]}" bench probe --recipe "$size" --recipe-dir "$recipes" --device "$device" --dtype "$dtype" \
  --steps 5 --json "$work/results/probe.json" "${probe_extra[@]}"
step train-eager 60 "${dx[@]}" bench train "${common[@]}" --profile 8 --json "$work/results/train-eager.json"
echo "=== done in ${SECONDS} s: $out/summary.md, $out/results.tar"
