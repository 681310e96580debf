//! Text a constraint forces is tokenized to exactly its bytes: a SentencePiece tokenizer's
//! pipeline puts `▁` before every fragment it is given, which the constraint would refuse.

use ferry_grammar::Grammars;
use ferry_tokenize::gguf::{Value, parse};
use ferry_tokenize::gguf_write::encode;
use ferry_tokenize::{Constraint, Tokenizer};

/// A small SentencePiece vocabulary (GGUF `"llama"`): control tokens, byte fallback, and the
/// pieces of "hello world".
fn spm() -> Tokenizer {
    let mut pieces: Vec<(String, f64, i64)> =
        vec![("<unk>".into(), 0.0, 2), ("<s>".into(), 0.0, 3), ("</s>".into(), 0.0, 3)];
    pieces.extend((0..=255u8).map(|b| (format!("<0x{b:02X}>"), 0.0, 6)));
    for (i, p) in ["▁", "h", "e", "l", "o", "w", "r", "d", "ll", "▁h", "▁he", "▁hell", "▁hello", "▁w", "or", "▁wor"]
        .iter()
        .enumerate()
    {
        pieces.push((p.to_string(), -(i as f64), 1));
    }
    let s = |v: &str| Value::Str(v.into());
    let md = vec![
        ("general.architecture".to_string(), s("llama")),
        ("tokenizer.ggml.model".to_string(), s("llama")),
        ("tokenizer.ggml.tokens".to_string(), Value::Array(pieces.iter().map(|p| s(&p.0)).collect())),
        ("tokenizer.ggml.scores".to_string(), Value::Array(pieces.iter().map(|p| Value::F64(p.1)).collect())),
        ("tokenizer.ggml.token_type".to_string(), Value::Array(pieces.iter().map(|p| Value::I64(p.2)).collect())),
        ("tokenizer.ggml.bos_token_id".to_string(), Value::U64(1)),
        ("tokenizer.ggml.eos_token_id".to_string(), Value::U64(2)),
    ];
    let header = parse(&encode(&md, &[])).expect("header");
    Tokenizer::from_gguf(&header, pieces.len()).expect("tokenizer")
}

#[test]
fn forced_text_is_exactly_the_constraints_bytes_on_sentencepiece() {
    let tok = spm();
    // The pipeline's own ids for a fragment start with `▁`: not what a constraint forces.
    let own = tok.encode_without_bos("hello").expect("encode");
    assert!(tok.id_to_token(own[0]).is_some_and(|t| t.starts_with('▁')), "{own:?}");
    let g = Grammars::new(tok.clone());
    let mut m = g.matcher(&Constraint::Regex("hello world".into())).expect("compiles");
    let forced = m.compute_ff_tokens();
    assert!(!forced.is_empty(), "a fixed text is forced");
    let bytes: Vec<u8> = forced.iter().flat_map(|&t| tok.token_bytes(t)).collect();
    assert!(b"hello world".starts_with(&bytes), "forced {:?}", String::from_utf8_lossy(&bytes));
    m.consume_tokens(&forced).expect("the constraint takes its own forced tokens");
    assert!(!m.is_error(), "{:?}", m.get_error());
}
