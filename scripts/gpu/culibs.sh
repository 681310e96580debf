# Sourced by step1.sh and step2.sh on the GPU machine. cudarc opens the CUDA libraries at run
# time by name: `libnvrtc.so`/`libcublas.so` (unversioned) or the CUDA 12 names
# (`.so.12`); a CUDA 13 machine may only have `.so.13` files, or keep them in a Python
# wheel's folder. Finds each library, links the unversioned name to it in a folder of ours,
# and puts that folder and the libraries' own folders on LD_LIBRARY_PATH.
culibs() {
  local links=/tmp/ferry-culibs dirs=() lib found
  mkdir -p "$links"
  for lib in libcuda.so libnvrtc.so libcublas.so libcublasLt.so; do
    found=$(ls -1 /usr/local/cuda/lib64/"$lib"* /usr/local/cuda/targets/x86_64-linux/lib/"$lib"* \
      /usr/local/nvidia/lib64/"$lib"* /usr/lib/x86_64-linux-gnu/"$lib"* /usr/lib64/"$lib"* \
      /opt/*/.venv/lib/python3*/site-packages/nvidia/*/lib/"$lib"* \
      /usr/local/lib/python3*/dist-packages/nvidia/*/lib/"$lib"* 2>/dev/null | sort -V | tail -1)
    [ -n "$found" ] || found=$(find /usr /opt /lib -xdev -name "$lib*" -not -path '*/stubs/*' 2>/dev/null | sort -V | tail -1)
    echo "$lib -> ${found:-NOT FOUND}"
    [ -n "$found" ] || continue
    dirs+=("$(dirname "$found")")
    ln -sf "$found" "$links/$lib"
  done
  local path="$links"
  for d in "${dirs[@]}"; do path="$path:$d"; done
  export LD_LIBRARY_PATH="$path${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
}
