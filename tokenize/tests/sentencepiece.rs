//! A SentencePiece (`tokenizer.ggml.model = "llama"`) GGUF vocabulary becomes a working
//! tokenizer: score-ranked merges, `▁` for spaces, byte fallback, BOS by default.

use ferry_tokenize::Tokenizer;
use ferry_tokenize::gguf::{Value, parse};
use ferry_tokenize::gguf_write::encode;

fn spm_tokenizer(add_bos: Option<bool>) -> Tokenizer {
    let mut pieces: Vec<(String, f64, i64)> =
        vec![("<unk>".into(), 0.0, 2), ("<s>".into(), 0.0, 3), ("</s>".into(), 0.0, 3)];
    pieces.extend((0..=255u8).map(|b| (format!("<0x{b:02X}>"), 0.0, 6)));
    // Normal pieces; a higher score merges earlier.
    for (p, s) in [
        ("▁", -1.0),
        ("h", -2.0),
        ("e", -2.0),
        ("l", -2.0),
        ("o", -2.0),
        ("w", -2.0),
        ("r", -2.0),
        ("d", -2.0),
        ("ll", -3.0),
        ("▁h", -4.0),
        ("▁he", -5.0),
        ("▁hell", -6.0),
        ("▁hello", -7.0),
        ("▁w", -4.5),
        ("or", -4.6),
        ("▁wor", -6.5),
        ("▁worl", -7.5),
        ("▁world", -8.0),
    ] {
        pieces.push((p.into(), s, 1));
    }
    let s = |v: &str| Value::Str(v.into());
    let mut md = vec![
        ("general.architecture".to_string(), s("llama")),
        ("tokenizer.ggml.model".to_string(), s("llama")),
        ("tokenizer.ggml.tokens".to_string(), Value::Array(pieces.iter().map(|p| s(&p.0)).collect())),
        ("tokenizer.ggml.scores".to_string(), Value::Array(pieces.iter().map(|p| Value::F64(p.1)).collect())),
        ("tokenizer.ggml.token_type".to_string(), Value::Array(pieces.iter().map(|p| Value::I64(p.2)).collect())),
        ("tokenizer.ggml.bos_token_id".to_string(), Value::U64(1)),
        ("tokenizer.ggml.eos_token_id".to_string(), Value::U64(2)),
        ("tokenizer.ggml.unknown_token_id".to_string(), Value::U64(0)),
    ];
    if let Some(b) = add_bos {
        md.push(("tokenizer.ggml.add_bos_token".to_string(), Value::Bool(b)));
    }
    let header = parse(&encode(&md, &[])).expect("header");
    Tokenizer::from_gguf(&header, pieces.len()).expect("tokenizer")
}

#[test]
fn words_merge_by_score_and_round_trip() {
    let tok = spm_tokenizer(None);
    let ids = tok.encode("hello world").expect("encode");
    let text: Vec<String> = ids.iter().map(|&i| tok.id_to_token(i).expect("id")).collect();
    assert_eq!(text, vec!["<s>", "▁hello", "▁world"]);
    assert_eq!(tok.decode(&ids, true).expect("decode"), "hello world");
    assert!(tok.eos_ids().contains(&2));
}

#[test]
fn unknown_characters_fall_back_to_bytes() {
    let tok = spm_tokenizer(Some(false));
    let ids = tok.encode("hé").expect("encode");
    let text: Vec<String> = ids.iter().map(|&i| tok.id_to_token(i).expect("id")).collect();
    assert_eq!(text, vec!["▁h", "<0xC3>", "<0xA9>"]);
    assert_eq!(tok.decode(&ids, true).expect("decode"), "hé");
    let mut d = ferry_tokenize::Detokenizer::new(true);
    let pieces: Vec<String> = ids.iter().map(|&i| d.push(&tok, i).expect("push")).collect();
    assert_eq!(pieces.concat(), "hé");
    assert!(pieces.iter().all(|p| !p.contains('\u{FFFD}')));
    // Logprobs report each token's raw bytes: they spell the text (with the leading space
    // SentencePiece adds), the bytes of a split character apart.
    let bytes: Vec<Vec<u8>> = ids.iter().map(|&i| tok.token_bytes(i)).collect();
    assert_eq!(bytes, vec![b" h".to_vec(), vec![0xc3], vec![0xa9]]);
    assert_eq!(ferry_tokenize::token_display(&bytes[1]), "bytes:\\xc3");
}
