//! Tokenization: any text through Ferry's byte-level BPE fast path and its head cache must
//! give HF `tokenizers`' ids, for each pre-tokenizer the fast path accepts (the tiny model's
//! vocabulary written as GGUF with `smollm`, `llama-bpe`, `qwen2` and `gpt2` pre-tokenizers).
#![no_main]

use std::sync::OnceLock;

use ferry_engine::tiny::{TinySpec, write_gguf};
use ferry_tokenize::{ServedModel, Tokenizer};
use libfuzzer_sys::fuzz_target;

fn tokenizers() -> &'static [Tokenizer] {
    static TOKS: OnceLock<Vec<Tokenizer>> = OnceLock::new();
    TOKS.get_or_init(|| {
        let dir = tempfile::tempdir().expect("temp dir");
        ["smollm", "llama-bpe", "qwen2", "gpt2"]
            .iter()
            .map(|pre| {
                let path = dir.path().join(format!("{pre}.gguf"));
                let spec = TinySpec {
                    hidden: 8,
                    ffn: 16,
                    layers: 1,
                    heads: 2,
                    kv_heads: 1,
                    ctx: 64,
                    merges: 300,
                    tokenizer_pre: pre,
                    ..TinySpec::default()
                };
                write_gguf(&path, &spec).expect("tiny model");
                let tok = ServedModel::load(&path).expect("model").tokenizer;
                assert!(tok.is_fast(), "{pre}: {:?}", tok.why_not_fast());
                tok.with_head_cache(1 << 20)
            })
            .collect()
    })
}

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    for tok in tokenizers() {
        let want = tok.encode_hf(&text).expect("hf");
        assert_eq!(tok.encode(&text).expect("fast"), want, "{text:?}");
        // Again: the words and segments now come from the caches.
        assert_eq!(tok.encode(&text).expect("fast"), want, "cached: {text:?}");
    }
});
