#!/usr/bin/env bash
# GPU machine, instead of step2.sh when only the figures are wanted (after step1.sh):
#   bash target/gpu-stash/profile.sh target/gpu-kit/b
# The engine bench on CUDA with FERRY_CUDA_PROFILE=1: tokens/s, then where a decode step's
# time goes, operation by operation, for SmolLM2 and the Llama-3-8B shape (8 layers).
set -uo pipefail
part_b=$(cd "$1" && pwd)
out=${OUT:-/tmp/gpu-out}
mkdir -p "$out"
cd "$(dirname "$0")"
[ -f model.gguf ] || cat model.part-a "$part_b/model.part-b" > model.gguf
echo "$(cat model.sha256)  model.gguf" | sha256sum -c - > "$out/model-check.txt" 2>&1 || { cat "$out/model-check.txt"; exit 3; }
. ./culibs.sh
culibs > /dev/null 2>&1
export FERRY_SMOLLM2="$PWD/model.gguf" FERRY_CUDA_PROFILE=1 FERRY_BENCH_QUICK=1
FERRY_BENCH_SHAPES=smollm2 FERRY_BENCH_DEVICES=cuda timeout 120 ./bench --bench > "$out/profile-smollm2.txt" 2>&1
echo "rc=$?" >> "$out/profile-smollm2.txt"
FERRY_BENCH_8B_LAYERS=8 FERRY_BENCH_SHAPES=llama3-8b FERRY_BENCH_DEVICES=cuda timeout 150 ./bench --bench > "$out/profile-llama3-8b.txt" 2>&1
echo "rc=$?" >> "$out/profile-llama3-8b.txt"
cat "$out"/profile-*.txt
