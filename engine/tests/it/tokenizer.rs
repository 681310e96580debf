//! Tokenizer, chat template and incremental detokenizer on the tiny model and SmolLM2.

use crate::common::{TinyModel, load, smollm2};
use ferry_engine::tiny::TinySpec;
use ferry_engine::{ChatMessage, Detokenizer, Tokenizer};

fn stream(tok: &Tokenizer, ids: &[u32]) -> Vec<String> {
    let mut d = Detokenizer::new(true);
    let mut pieces: Vec<String> = ids.iter().map(|&i| d.push(tok, i).expect("push")).collect();
    pieces.push(d.flush(tok).expect("flush"));
    pieces
}

const TEXTS: &[&str] = &[
    "Hello world! The ferry crossed 12345 rivers.",
    "Ünïcödé — naïve café, 東京タワー, emoji 🚢🌊 and a tab\tor two.\n\nNew paragraph.",
];

#[test]
fn detokenizer_never_emits_half_a_character() {
    for tok in
        [load(&TinyModel::new(TinySpec::default()).hf()).tokenizer().clone(), load(&smollm2()).tokenizer().clone()]
    {
        for text in TEXTS {
            let ids = tok.encode(text).expect("encode");
            let pieces = stream(&tok, &ids);
            assert!(pieces.iter().all(|p| !p.contains('\u{FFFD}')), "{pieces:?}");
            assert_eq!(pieces.concat(), *text);
            assert_eq!(tok.decode(&ids, true).expect("decode"), *text);
        }
    }
}

#[test]
fn smollm2_special_tokens_and_chat_template() {
    let model = load(&smollm2());
    let tok = model.tokenizer();
    assert_eq!(tok.bos_id(), Some(1));
    assert!(!tok.adds_bos(), "SmolLM2 must not get a BOS prepended");
    assert!(tok.eos_ids().contains(&2) && tok.eos_ids().contains(&0), "{:?}", tok.eos_ids());
    // Digits split one per token.
    let ids = tok.encode("2024").expect("encode");
    assert_eq!(ids.len(), 4, "{ids:?}");
    let text = tok.chat_template().expect("template").render(&[ChatMessage::new("user", "Hi")], true).expect("render");
    assert!(text.starts_with("<|im_start|>system\n"), "default system turn: {text}");
    assert!(text.ends_with("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"), "{text}");
    let ids = tok.encode(&text).expect("encode");
    assert_eq!(ids[0], 1, "<|im_start|> is one control token");
    assert_eq!(ids.iter().filter(|&&i| i == 2).count(), 2, "two <|im_end|>");
}

#[test]
fn tiny_chat_template_renders_and_tokenizes() {
    let model = load(&TinyModel::new(TinySpec::default()).gguf());
    let tok = model.tokenizer();
    let text = tok
        .chat_template()
        .expect("template")
        .render(&[ChatMessage::new("system", "S"), ChatMessage::new("user", "U")], false)
        .expect("render");
    assert_eq!(text, "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n");
    assert_eq!(tok.encode(&text).expect("encode").first(), Some(&1));
}
