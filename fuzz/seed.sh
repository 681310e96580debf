#!/usr/bin/env bash
# Writes the fuzz targets' seed inputs into fuzz/corpus/<target>/ (kept in the repository;
# libFuzzer adds what it finds next to them).
set -euo pipefail
cd "$(dirname "$0")"
tmp=$(mktemp -d)
cargo run --quiet --manifest-path ../Cargo.toml -p ferry-engine --example tiny_model -- "$tmp" --small
mkdir -p corpus/gguf corpus/safetensors corpus/http_request corpus/kv_events
cp "$tmp/tiny.gguf" corpus/gguf/seed-tiny
cp "$tmp/hf/model.safetensors" corpus/safetensors/seed-tiny.safetensors
# http_request: the first byte picks the endpoint (even: completions, odd: chat).
printf '\x00{"model":"hf","prompt":"hello there","max_tokens":4,"temperature":0}' >corpus/http_request/seed-completion
printf '\x00{"model":"hf","prompt":[1,2,3],"stop":["a"],"top_p":0.5,"stream":true}' >corpus/http_request/seed-ids
printf '\x01{"model":"hf","messages":[{"role":"user","content":"hi"}],"max_completion_tokens":3}' >corpus/http_request/seed-chat
printf '\x00{"model":"hf","prompt":["hi","there"],"n":2,"echo":true,"logprobs":1}' >corpus/http_request/seed-batch
printf '\x00{"model":"hf","prompt":[[1,2],[3]],"max_tokens":0,"echo":true}' >corpus/http_request/seed-batch-ids
printf '\x01{"model":"hf","messages":[{"role":"user","content":"hi"}],"logit_bias":{"7":100,"8":-100}}' >corpus/http_request/seed-logit-bias
# kv_events: [slot, length, KvEventBatch bytes]... (protobuf written by hand: epoch 1, one
# snapshot event, then one stored event in sequence).
python3 - <<'PY'
def varint(n):
    out = b""
    while True:
        b, n = n & 0x7F, n >> 7
        out += bytes([b | (0x80 if n else 0)])
        if not n:
            return out
def field(num, payload):  # length-delimited
    return varint((num << 3) | 2) + varint(len(payload)) + payload
def num(num, v):  # varint
    return varint(num << 3) + varint(v)
def stored(parent, hashes, tokens):  # KvStored
    return num(1, parent) + field(2, b"".join(map(varint, hashes))) + field(3, b"".join(map(varint, tokens)))
def event(seq, kind, body):  # KvEvent: stored=2, removed=3, snapshot=4
    return num(1, seq) + field(kind, body)
def batch(epoch, events):  # KvEventBatch
    return field(1, b"p0") + num(2, epoch) + b"".join(field(3, e) for e in events)
snap = event(1, 4, field(1, stored(0, [11, 12], [1, 2, 3, 4, 5, 6, 7, 0])))
more = event(2, 2, stored(12, [13], [4, 4, 4, 4]))
gone = event(3, 3, field(1, varint(13)))
frames = [batch(1, [snap]), batch(1, [more, gone]), batch(2, [more])]
with open("corpus/kv_events/seed-batches", "wb") as f:
    for i, fr in enumerate(frames):
        assert len(fr) < 256
        f.write(bytes([i % 3 if i < 2 else 0, len(fr)]) + fr)
PY
# tokenize: prose in several scripts, wide spaces, numbers, combining marks and emoji.
mkdir -p corpus/tokenize
printf 'The ferry crossed at dawn.  Паром пересёк реку в 2024 году.\n渡轮在黎明时分穿过河流，船长写了信。\u3000αλφα ς 한국어 タワー 〇 e\u0301 ²³ 🚢🌊<|im_start|>user\n' >corpus/tokenize/seed-scripts
rm -rf "$tmp"
ls -la corpus/*
