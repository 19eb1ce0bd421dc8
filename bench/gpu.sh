#!/usr/bin/env bash
# The speed issue's whole target table on one CUDA GPU, in one command (results and figures in bench/results/):
#   bash bench/gpu.sh
# 1. training step, every variant against the baseline, FLOP-rate ratios at seq 512 and 2048 (the CPU table's setup);
# 2. DINT's peak memory against DIFF V1's at seq 8192;
# 3. one attention layer alone on sdpa, flash_attn (where installed) and the Triton kernels (backend triton),
#    forward and backward;
# 4. the training step at 125M-class size (GPT-2 small's width and depth), seq 2048, with the baseline's MFU;
# 5. decoding with the KV cache, eager and compiled (CUDA graphs), with the fraction of the memory bound;
#    then compiled at a larger, more memory-bound size, and with bf16 weights and cache at 16K (near the bound);
# 6. where a compiled fp32 decoding step's GPU time goes, per variant (--profile: the top kernels a token).
# Add --dtype fp32 to any line to compare with the CPU table in the README.
set -euo pipefail
diffexp bench train --device cuda --dtype bf16 --d-model 256 --n-layers 4 --n-heads 4 --seq-lens 512 2048 \
  --tokens-per-batch 4096 --batch-size 8 --rounds 5 --steps 10
diffexp bench train --device cuda --dtype bf16 --d-model 256 --n-layers 4 --n-heads 4 --variants diff_v1 dint \
  --seq-lens 8192 --batch-size 1 --rounds 3 --steps 5
backends="sdpa triton"
python -c "import flash_attn" 2>/dev/null && backends="sdpa flash_attn triton"  # the optional extra
diffexp bench kernel --device cuda --dtype bf16 --d-model 1024 --n-heads 8 --seq-lens 2048 8192 --batch-size 4 \
  --backends $backends --rounds 5 --steps 10
diffexp bench train --device cuda --dtype bf16 --d-model 768 --n-layers 12 --n-heads 12 --seq-lens 2048 \
  --batch-size 8 --rounds 2 --steps 5
diffexp bench decode --device cuda --d-model 1024 --n-layers 4 --n-heads 8 --kv-heads 2 --seq-lens 1024 4096 \
  --batch-size 1 8 --modes eager compiled --rounds 3 --steps 5 --no-memory
diffexp bench decode --device cuda --d-model 2048 --n-layers 4 --n-heads 16 --kv-heads 4 --seq-lens 8192 \
  --batch-size 8 --modes compiled --rounds 3 --steps 3 --no-memory
diffexp bench decode --device cuda --dtype bf16 --d-model 2048 --n-layers 4 --n-heads 16 --kv-heads 4 --seq-lens 16384 \
  --batch-size 8 --modes compiled --rounds 2 --steps 2 --new-tokens 16 --no-memory
diffexp bench decode --device cuda --modes compiled --d-model 1024 --n-layers 4 --n-heads 8 --kv-heads 2 \
  --seq-lens 4096 --batch-size 1 --rounds 1 --steps 2 --new-tokens 32 --no-memory --profile 5
