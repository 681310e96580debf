#!/usr/bin/env bash
# GPU machine, call 2 (carry target/gpu-kit/b), after step1.sh on the same warm machine:
#   bash target/gpu-stash/step2.sh target/gpu-kit/b     (CUDA_ONLY=1: skip the CPU comparison)
# Joins SmolLM2, runs its parity test, `ferry up --device cuda` answering through the router
# with a short `ferry bench` (and the same on the CPU for comparison), then the engine bench.
set -uo pipefail
part_b=$(cd "$1" && pwd)
out=${OUT:-/tmp/gpu-out}
mkdir -p "$out"
cd "$(dirname "$0")"
cat model.part-a "$part_b/model.part-b" > model.gguf
echo "$(cat model.sha256)  model.gguf" | sha256sum -c - > "$out/model-check.txt" 2>&1 || { cat "$out/model-check.txt"; exit 3; }
. ./culibs.sh
culibs > /dev/null 2>&1
export FERRY_SMOLLM2="$PWD/model.gguf" RUST_BACKTRACE=1
timeout 90 ./parity cuda_parity::cpu_and_cuda_agree_on_smollm2 --nocapture > "$out/parity-smollm2.txt" 2>&1
echo "rc=$?" >> "$out/parity-smollm2.txt"

# A whole cluster on the GPU (and at the end on the CPU, for comparison), asked one question
# and benched for 15 s.
cluster() { # device
  local dev=$1 log="$out/up-$1.txt"
  ./ferry up --model "$FERRY_SMOLLM2" --device "$dev" --http-addr 127.0.0.1:18000 --grpc-addr 127.0.0.1:17000 > "$log" 2>&1 &
  local pid=$!
  for _ in $(seq 1 60); do grep -q "ferry up: ready" "$log" && break; kill -0 $pid 2>/dev/null || break; sleep 1; done
  python3 - >> "$log" 2>&1 <<'PY'
import json, urllib.request
req = urllib.request.Request("http://127.0.0.1:18000/v1/chat/completions", data=json.dumps({
    "model": "model", "max_tokens": 32, "temperature": 0,
    "messages": [{"role": "user", "content": "What is the capital of France?"}]}).encode(),
    headers={"content-type": "application/json"})
print("ANSWER:", urllib.request.urlopen(req, timeout=60).read().decode())
PY
  timeout 40 ./ferry bench --url http://127.0.0.1:18000 --duration 15 --concurrency 16 --output-len 64 --quiet \
    --json "$out/bench-up-$dev.json" >> "$log" 2>&1
  echo "bench rc=$?" >> "$log"
  kill -INT $pid; timeout 30 tail --pid=$pid -f /dev/null; echo "up exit: $(wait $pid; echo $?)" >> "$log"
}
cluster cuda

FERRY_BENCH_SHAPES=smollm2 FERRY_BENCH_DEVICES=cuda timeout 90 ./bench --bench > "$out/bench-smollm2.txt" 2>&1
echo "rc=$?" >> "$out/bench-smollm2.txt"
# The Llama-3-8B shape on the GPU only, 8 of its 32 layers (all 8 B random weights take minutes
# to generate and load; per-layer figures scale).
FERRY_BENCH_8B_LAYERS=8 FERRY_BENCH_SHAPES=llama3-8b FERRY_BENCH_DEVICES=cuda timeout 150 ./bench --bench > "$out/bench-llama3-8b.txt" 2>&1
echo "rc=$?" >> "$out/bench-llama3-8b.txt"
# The CPU for comparison (last: the least needed; CUDA_ONLY=1 skips it).
if [ -z "${CUDA_ONLY:-}" ]; then
  cluster cpu
  FERRY_BENCH_SHAPES=smollm2 FERRY_BENCH_DEVICES=cpu timeout 100 ./bench --bench > "$out/bench-smollm2-cpu.txt" 2>&1
  echo "rc=$?" >> "$out/bench-smollm2-cpu.txt"
fi
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,clocks.mem --format=csv >> "$out/nvidia-smi.txt" 2>&1
tail -n 25 "$out"/parity-smollm2.txt "$out"/up-*.txt "$out"/bench-*.txt
