#!/usr/bin/env python3
"""Independent reference for a Llama GGUF, written the llama.cpp way.

Reads tensors with the `gguf` package (gguf-py, llama.cpp's own reader and dequantizer),
keeps Q/K rows as the GGUF stores them and rotates *adjacent* pairs (2i, 2i+1) — the
LLAMA rope of llama.cpp — whereas Ferry un-permutes Q/K and rotates (i, i + d/2). If either
side gets the permutation wrong, logits disagree.

Usage: smollm2_reference.py MODEL.gguf IDS N  → prints JSON {tokens, logprobs, first_logits_top}
IDS is comma-separated prompt ids; N greedy tokens are generated (no early stop).
"""
import json
import sys

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize


def main() -> None:
    path, ids, n = sys.argv[1], [int(x) for x in sys.argv[2].split(",")], int(sys.argv[3])
    r = GGUFReader(path)

    def field(name):
        f = r.fields[name]
        return f.parts[f.data[0]][0]

    arch = "llama"
    n_layer = int(field(f"{arch}.block_count"))
    n_head = int(field(f"{arch}.attention.head_count"))
    n_kv = int(field(f"{arch}.attention.head_count_kv"))
    eps = float(field(f"{arch}.attention.layer_norm_rms_epsilon"))
    base = float(field(f"{arch}.rope.freq_base"))
    t = {}
    for ten in r.tensors:
        w = dequantize(ten.data, ten.tensor_type).astype(np.float32)
        t[ten.name] = w.reshape([int(d) for d in reversed(ten.shape.tolist())])
    emb = t["token_embd.weight"]
    out_w = t.get("output.weight", emb)
    d = emb.shape[1]
    hd = d // n_head

    def norm(x, w):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w

    inv = base ** (-np.arange(0, hd, 2, dtype=np.float64) / hd)

    def rope(x, pos):  # x: (T, heads, hd); adjacent pairs
        ang = np.outer(pos, inv)  # (T, hd/2)
        c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        a, b = x[..., 0::2], x[..., 1::2]
        y = np.empty_like(x)
        y[..., 0::2] = a * c - b * s
        y[..., 1::2] = b * c + a * s
        return y

    def forward(tokens):
        T = len(tokens)
        x = emb[tokens].astype(np.float64)
        pos = np.arange(T)
        mask = np.triu(np.full((T, T), -np.inf), 1)
        for l in range(n_layer):
            p = f"blk.{l}."
            h = norm(x, t[p + "attn_norm.weight"])
            q = (h @ t[p + "attn_q.weight"].T).reshape(T, n_head, hd)
            k = (h @ t[p + "attn_k.weight"].T).reshape(T, n_kv, hd)
            v = (h @ t[p + "attn_v.weight"].T).reshape(T, n_kv, hd)
            q, k = rope(q, pos), rope(k, pos)
            rep = n_head // n_kv
            k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
            att = np.einsum("thd,shd->hts", q, k) / np.sqrt(hd) + mask
            att = np.exp(att - att.max(-1, keepdims=True))
            att /= att.sum(-1, keepdims=True)
            o = np.einsum("hts,shd->thd", att, v).reshape(T, n_head * hd)
            x = x + o @ t[p + "attn_output.weight"].T
            h = norm(x, t[p + "ffn_norm.weight"])
            g = h @ t[p + "ffn_gate.weight"].T
            u = h @ t[p + "ffn_up.weight"].T
            x = x + (g / (1 + np.exp(-g)) * u) @ t[p + "ffn_down.weight"].T
        return norm(x[-1], t["output_norm.weight"]) @ out_w.T

    seq = list(ids)
    toks, lps, first = [], [], None
    for _ in range(n):
        logits = forward(seq)
        lse = np.log(np.sum(np.exp(logits - logits.max()))) + logits.max()
        if first is None:
            top = np.argsort(-logits)[:10]
            first = [[int(i), float(logits[i])] for i in top]
        nxt = int(np.argmax(logits))
        toks.append(nxt)
        lps.append(float(logits[nxt] - lse))
        seq.append(nxt)
    print(json.dumps({"tokens": toks, "logprobs": lps, "first_logits_top": first}))


if __name__ == "__main__":
    main()
