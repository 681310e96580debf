#!/usr/bin/env python3
"""Writes random tensors of every type Ferry dequantizes, plus gguf-py's dequantization.

Usage: ggml_quants.py OUT_DIR → OUT_DIR/quants.gguf and OUT_DIR/<TYPE>.f32 (raw little-endian).
gguf-py is llama.cpp's own Python reference; Ferry's Rust dequantizer must agree with it.
"""
import sys
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as T, GGUFWriter
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize

out = Path(sys.argv[1])
rng = np.random.default_rng(1234)
w = GGUFWriter(str(out / "quants.gguf"), "llama")
for ty in [T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q8_0, T.Q4_K, T.Q6_K]:
    block, size = GGML_QUANT_SIZES[ty]
    n_blocks = 16
    raw = rng.integers(0, 256, size=n_blocks * size, dtype=np.uint8)
    # Keep the f16 / bf16 scales finite and small: write them explicitly.
    blocks = raw.reshape(n_blocks, size)
    def f16(v):
        return np.frombuffer(np.float16(v).tobytes(), dtype=np.uint8)
    for b in blocks:
        if ty in (T.Q4_0, T.Q8_0):
            b[0:2] = f16(rng.uniform(-0.1, 0.1))
        elif ty in (T.Q4_1, T.Q4_K):
            b[0:2] = f16(rng.uniform(-0.1, 0.1))
            b[2:4] = f16(rng.uniform(-0.1, 0.1))
        elif ty == T.Q6_K:
            b[208:210] = f16(rng.uniform(-0.1, 0.1))
    if ty == T.F16:
        raw = rng.uniform(-2, 2, size=n_blocks * 32).astype(np.float16).view(np.uint8)
    if ty == T.BF16:
        raw = (rng.uniform(-2, 2, size=n_blocks * 32).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    raw = raw.reshape(1, -1)
    w.add_tensor(ty.name, raw, raw_shape=raw.shape, raw_dtype=ty)
    dequantize(raw, ty).astype("<f4").tofile(out / f"{ty.name}.f32")
w.write_header_to_file()
w.write_kv_data_to_file()
w.write_tensors_to_file()
w.close()
