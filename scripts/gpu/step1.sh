#!/usr/bin/env bash
# GPU machine, call 1 (carry target/gpu-kit/a; see scripts/gpu-kit): stashes the kit in
# target/gpu-stash (ignored, kept by a warm machine for call 2), unpacks the binaries, finds
# the CUDA libraries, then runs the kernel-by-kernel test, the tiny model's parity test and the
# daemons' start on the GPU (every test of feature `gpu-tests` but SmolLM2's parity, in step 2).
set -uo pipefail
kit=$(cd "$(dirname "$0")" && pwd)
out=${OUT:-/tmp/gpu-out}
mkdir -p "$out" target/gpu-stash
stash=$(cd target/gpu-stash && pwd)
cp "$kit"/* "$stash"/
cd "$stash"
for b in ops parity disagg bench ferry; do
  python3 -c "import lzma,shutil,sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2],'wb'))" "$b.xz" "$b" && chmod +x "$b"
done
ls -la > "$out/stash.txt"
nvidia-smi > "$out/nvidia-smi.txt" 2>&1
. ./culibs.sh
culibs > "$out/culibs.txt" 2>&1
export RUST_BACKTRACE=1
timeout 120 ./ops --nocapture --test-threads 1 > "$out/ops.txt" 2>&1
echo "rc=$?" >> "$out/ops.txt"
timeout 120 ./parity cuda_parity::cpu_and_cuda_agree_on_a_tiny_model --nocapture > "$out/parity-tiny.txt" 2>&1
echo "rc=$?" >> "$out/parity-tiny.txt"
timeout 60 ./disagg cuda_daemons_start_on_gpu_0_with_mirrored_pools --nocapture > "$out/disagg.txt" 2>&1
echo "rc=$?" >> "$out/disagg.txt"
tail -n 30 "$out/culibs.txt" "$out/ops.txt" "$out/parity-tiny.txt" "$out/disagg.txt"
