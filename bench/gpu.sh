#!/usr/bin/env bash
# The GPU speed issue's measurements on one H100 or H200, in one command of at most 8 minutes, offline:
#   bash bench/gpu.sh OUT_DIR
# run from the repository root. It writes into OUT_DIR: summary.md (every table), gpu.log (all output), the results
# JSONs (probe.json, train-compiled-a.json, train-compiled-b.json, train-eager.json, fit.json) and failed.txt (steps
# that failed or ran out of time; the others still run). Scratch (run directories, plots) goes to $DIFFEXP_GPU_WORK
# (default /tmp/diffexp-gpu). Packages the GPU image lacks are installed from wheels in .whl/ (docs/gpu.md).
#  1. probe: which SDPA backends take the 125m recipe's attention calls; each differential formulation's cost;
#     then the kernels the door picks on CUDA (diffexp/kernels) against the eager maps, every variant, bf16;
#  2. the five variants at the 125m recipe's own shape (32K vocab, seq 2048, micro-batch 8), bf16, compiled, in two
#     runs (each with the baseline) so that one slow compile cannot lose every row;
#  3. the same, eager;
#  4. a short real `diffexp fit` of the 125m DIFF V1 recipe at that shape (MQAR tokens over the 32K vocabulary, made
#     in memory: no download), compiled as the recipe says: what the trainer adds to the bench step of that model.
# DIFFEXP_GPU_SH_SMOKE=1 runs the same steps on the CPU at a tiny size from DIFFEXP_GPU_RECIPE_DIR (tests do).
set -uo pipefail
out=${1:?usage: bash bench/gpu.sh OUT_DIR}
mkdir -p "$out" || exit 2
out=$(cd "$out" && pwd)
work=${DIFFEXP_GPU_WORK:-/tmp/diffexp-gpu}
mkdir -p "$work"
: >"$out/failed.txt"
exec > >(tee -a "$out/gpu.log") 2>&1

budget=${DIFFEXP_GPU_BUDGET_S:-470}   # the whole script's seconds; each step gets at most what is left
size=${DIFFEXP_GPU_SIZE:-125m}
recipes=${DIFFEXP_GPU_RECIPE_DIR:-recipes/gpu}
device=cuda dtype=bf16 rounds=2 steps=3 fit_steps=30 seq=() fit_rows=8 fit_seq=2048 fit_pairs=64 fit_extra=()
if [ "${DIFFEXP_GPU_SH_SMOKE:-0}" = 1 ]; then
  device=cpu dtype=fp32 rounds=1 steps=1 fit_steps=4 seq=(--seq-lens 32 --batch-size 1) fit_rows=1 fit_seq=32 fit_pairs=4
  fit_extra=(--trainer.accelerator cpu --trainer.devices 1 --model.compile false)
fi

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

step() {  # step NAME CAP_SECONDS COMMAND...: runs it within min(CAP, what is left); a failure is noted, not fatal
  local name=$1 cap=$2; shift 2
  local left=$((budget - SECONDS)); local limit=$((cap < left ? cap : left))
  if [ "$limit" -lt 10 ]; then echo "$name: skipped, the ${budget} s budget is spent" | tee -a "$out/failed.txt"; return; fi
  echo "=== $name (at ${SECONDS} s, limit ${limit} s): $*"
  timeout --signal=INT --kill-after=10 "$limit" "$@"
  local rc=$?
  if [ $rc -ne 0 ]; then
    echo "$name: exit $rc$([ $rc -eq 124 ] && echo ", stopped at its ${limit} s limit")" | tee -a "$out/failed.txt"
  fi
}

common=(--recipe "$size" --recipe-dir "$recipes" --device "$device" --dtype "$dtype" --backend sdpa
        --rounds "$rounds" --steps "$steps" --warmup 1 "${seq[@]}")
step probe 60 "${dx[@]}" bench probe --recipe "$size" --recipe-dir "$recipes" --device "$device" --dtype "$dtype" \
  --steps 5 --json "$work/probe.json" $([ "${DIFFEXP_GPU_SH_SMOKE:-0}" = 1 ] && echo --seq-len 32 --batch-size 1)
if [ "$device" = cuda ]; then
  step kernels-check 70 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_decoding.py \
    -k "kernels_picked or (cuda_graph and (diff_v1 or dint))"
fi
step train-compiled-a 150 "${dx[@]}" bench train "${common[@]}" --compile --variants diff_v1 diff_v2 --profile 8 \
  --json "$work/train-compiled-a.json"
step train-compiled-b 120 "${dx[@]}" bench train "${common[@]}" --compile --variants shared_diff dint --profile 8 \
  --json "$work/train-compiled-b.json"
step train-eager 80 "${dx[@]}" bench train "${common[@]}" --profile 8 --json "$work/train-eager.json"
fit_dir="$work/fit-$(date +%Y%m%d-%H%M%S)"
fit=("${dx[@]}" fit --config "$recipes/base.yaml" --config "$recipes/size/$size.yaml"
     --config "$recipes/variant/diff_v1.yaml" --data diffexp.data.mqar.MQARDataModule --data.vocab_size 32768
     --data.num_kv_pairs "$fit_pairs" --data.seq_len "$fit_seq" --data.batch_size "$fit_rows" --data.num_workers 4
     --global_batch.rows "$fit_rows" --trainer.max_steps "$fit_steps" --trainer.val_check_interval "$fit_steps"
     --trainer.limit_val_batches 0 --trainer.log_every_n_steps 3 --checkpoint.every_n_train_steps 0
     --trainer.logger.init_args.save_dir "$fit_dir" "${fit_extra[@]}")
step fit 110 "${fit[@]}"
cp "$work"/probe.json "$work"/train-*.json "$out"/ 2>/dev/null
if [ -d "$fit_dir" ]; then
  python3 -m diffexp.bench.summary fit "$fit_dir" "$out/fit.json" diff_v1 "${fit[@]:2}" \
    || echo "fit: no tokens/s read from its logs" | tee -a "$out/failed.txt"
fi
python3 -m diffexp.bench.summary "$out" >/dev/null && echo "=== summary: $out/summary.md (${SECONDS} s in all)"
