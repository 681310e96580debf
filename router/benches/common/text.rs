//! What the tokenizer and end-to-end benches share: the served model's path, the words
//! their texts are made of, percentiles.

use std::path::PathBuf;

/// Words the benches' texts are drawn from: the first 51 plain English (the end-to-end bench
/// uses those), then numbers, other scripts and an emoji.
pub const WORDS: &[&str] = &[
    "the",
    "ferry",
    "crossed",
    "river",
    "at",
    "dawn",
    "and",
    "its",
    "captain",
    "wrote",
    "a",
    "long",
    "letter",
    "about",
    "weather",
    "tides",
    "cargo",
    "passengers",
    "who",
    "asked",
    "questions",
    "on",
    "deck",
    "while",
    "gulls",
    "circled",
    "over",
    "harbour",
    "lights",
    "engine",
    "room",
    "was",
    "warm",
    "quiet",
    "schedule",
    "changed",
    "twice",
    "because",
    "of",
    "fog",
    "wind",
    "from",
    "north",
    "east",
    "ticket",
    "price",
    "rose",
    "by",
    "12",
    "percent",
    "in",
    "2024",
    "travellers",
    "complained",
    "politely",
    "Rust",
    "code",
    "compiles",
    "faster",
    "than",
    "expected",
    "when",
    "cache",
    "is",
    "hot",
    "—",
    "naïve",
    "café",
    "東京",
    "🚢",
];

/// The SmolLM2 GGUF: `FERRY_SMOLLM2`, or where `ferry model fetch smollm2-135m` puts it.
pub fn model_path() -> PathBuf {
    if let Ok(p) = std::env::var("FERRY_SMOLLM2") {
        return PathBuf::from(p);
    }
    let home = std::env::var("HOME").unwrap_or_else(|_| "/root".into());
    let cache =
        std::env::var("FERRY_CACHE_DIR").map_or_else(|_| PathBuf::from(home).join(".cache/ferry"), PathBuf::from);
    cache.join("models/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf")
}

/// The `p` quantile of `v` (sorted here); NaN when empty.
pub fn pct(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * p).round() as usize]
}
