#!/usr/bin/env bash
# GPU machine, call 1 (carry target/gpu-kit/a; see scripts/gpu-kit): stashes the kit in
# target/gpu-stash (ignored, kept by a warm machine for call 2), unpacks the binaries, finds
# the CUDA libraries, then runs the kernel-by-kernel test and the tiny model's parity test.
set -uo pipefail
kit=$(cd "$(dirname "$0")" && pwd)
out=${OUT:-/tmp/gpu-out}
mkdir -p "$out" target/gpu-stash
stash=$(cd target/gpu-stash && pwd)
cp "$kit"/* "$stash"/
cd "$stash"
for b in ops parity bench ferry; do
  python3 -c "import lzma,shutil,sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2],'wb'))" "$b.xz" "$b" && chmod +x "$b"
done
ls -la > "$out/stash.txt"
nvidia-smi > "$out/nvidia-smi.txt" 2>&1
. ./culibs.sh
culibs > "$out/culibs.txt" 2>&1
export FERRY_REQUIRE_GPU=1 RUST_BACKTRACE=1
timeout 120 ./ops --nocapture --test-threads 1 > "$out/ops.txt" 2>&1
echo "rc=$?" >> "$out/ops.txt"
timeout 120 ./parity cuda_parity::cpu_and_cuda_agree_on_a_tiny_model --nocapture > "$out/parity-tiny.txt" 2>&1
echo "rc=$?" >> "$out/parity-tiny.txt"
tail -n 30 "$out/culibs.txt" "$out/ops.txt" "$out/parity-tiny.txt"
