//! Tokenizer, chat template and incremental detokenizer on the tiny model and SmolLM2.

use crate::common::{TinyModel, load, smollm2};
use ferry_engine::tiny::TinySpec;
use ferry_engine::{ChatMessage, Detokenizer, Tokenizer};

/// xorshift64 from `x`: the tests' random texts.
fn xorshift(mut x: u64) -> impl FnMut() -> u64 {
    move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    }
}

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

/// Random ids — any token, special ones, ids past the vocabulary — streamed piece by piece:
/// the pieces are HF's own decoding of all the ids (lossy where the bytes are not UTF-8), and
/// what has been emitted is always the start of HF's decoding of the ids so far.
#[test]
fn detokenizer_pieces_are_hfs_decoding_of_any_ids() {
    for tok in
        [load(&TinyModel::new(TinySpec::default()).hf()).tokenizer().clone(), load(&smollm2()).tokenizer().clone()]
    {
        let n = tok.vocab_size() as u64;
        let mut next = xorshift(0x5eed);
        for round in 0..300 {
            let ids: Vec<u32> = (0..1 + next() % 40)
                .map(|_| match next() % 10 {
                    0 => (next() % 20) as u32,      // control tokens
                    1 => (n + next() % 4) as u32,   // past the vocabulary
                    2..=4 => (next() % 300) as u32, // single bytes and short merges
                    _ => (next() % n) as u32,
                })
                .collect();
            let skip = round % 2 == 0;
            let mut d = Detokenizer::new(skip);
            let mut emitted = String::new();
            for (k, &id) in ids.iter().enumerate() {
                emitted.push_str(&d.push(&tok, id).expect("push"));
                let so_far = tok.hf().decode(&ids[..=k], skip).expect("decode");
                assert!(so_far.starts_with(&emitted), "{ids:?}: {emitted:?} is not the start of {so_far:?}");
            }
            emitted.push_str(&d.flush(&tok).expect("flush"));
            assert_eq!(emitted, tok.hf().decode(&ids, skip).expect("decode"), "{ids:?} (skip special {skip})");
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

/// Multi-turn chats (with the model's own template) and raw texts with special tokens written
/// in them: the head cache's ids are HF's ids, and a conversation's next turn reuses its head.
#[test]
fn head_cache_gives_hf_ids_and_reuses_earlier_turns() {
    let snippets = [
        "Hello world!",
        " leading space",
        "trailing space ",
        "\n\nNew paragraph.\n",
        "<|im_end|>",
        "<|im_start|>",
        "<|endoftext|>",
        "<|im_start|>user",
        "naïve café 東京 🚢",
        "12345 + 678",
        "   ",
        "<not special>",
        "\t",
    ];
    let mut next = xorshift(0x9e37_79b9_7f4a_7c15);
    for path in [smollm2(), TinyModel::new(TinySpec::default()).gguf()] {
        let tok = load(&path).tokenizer().clone().with_head_cache(8 << 20);
        let cache = tok.head_cache().expect("a vocabulary with <|im_start|> and <|im_end|> gets a head cache");
        let template = tok.chat_template().expect("template").clone();
        for conversation in 0..30 {
            let mut messages = vec![ChatMessage::new("system", "You are a ferry. Answer briefly.")];
            for turn in 0..6 {
                let mut say =
                    || (0..next() % 6).map(|_| snippets[(next() % snippets.len() as u64) as usize]).collect::<String>();
                messages.push(ChatMessage::new("user", say()));
                let text = template.render(&messages, true).expect("render");
                let hits = cache.stats().hit_tokens;
                let ids = tok.encode(&text).expect("cached");
                assert_eq!(
                    ids,
                    tok.encode_hf(&text).expect("plain"),
                    "conversation {conversation} turn {turn}: {text:?}"
                );
                assert!(
                    turn == 0 && conversation == 0 || cache.stats().hit_tokens > hits,
                    "the head was tokenized again"
                );
                messages.push(ChatMessage::new("assistant", say()));
            }
            let raw: String = (0..next() % 12).map(|_| snippets[(next() % snippets.len() as u64) as usize]).collect();
            assert_eq!(tok.encode(&raw).expect("cached"), tok.encode_hf(&raw).expect("plain"), "{raw:?}");
        }
    }
}

/// SmolLM2's and the tiny model's vocabularies take the fast byte-level BPE path, and it gives
/// HF's ids on texts that stress the pre-tokenizer (whitespace runs, digits, contractions,
/// scripts, emoji, special tokens written in the text).
#[test]
fn fast_bpe_gives_hf_ids() {
    let pieces = [
        "Hello",
        " world",
        "  ",
        "\n",
        "\n\n  ",
        "\r\n",
        "\t",
        "\u{a0}",
        "'s",
        "'LL",
        "don't",
        "2024",
        " 99",
        "½",
        "é",
        "naïve",
        " Größe",
        "Dvořák",
        "łódź",
        "Ærø",
        "×",
        "÷",
        "ª",
        "ſ",
        // Past the fast path's 64-byte stack merge.
        "pneumonoultramicroscopicsilicovolcanoconiosispneumonoultramicroscopic",
        "東京",
        "渡轮在黎明时分穿过河流，",
        "。",
        " паром",
        "Ёлка",
        " αλφα",
        "한국어",
        "\u{3000}",
        "\u{a0}",
        "〇",
        "🚢",
        "e\u{301}",
        "!!",
        " ?",
        "...",
        "<|im_start|>",
        "<|im_end|>",
        "<|endoftext|>",
        "the",
        "ing",
        "\u{4}",
        "a\u{1}b",
        "\u{7f}",
    ];
    let mut next = xorshift(0x2545_f491_4f6c_dd1d);
    for path in [smollm2(), TinyModel::new(TinySpec::default()).gguf()] {
        let model = load(&path);
        let tok = model.tokenizer();
        assert!(tok.is_fast(), "{} has no fast path: {:?}", path.display(), tok.why_not_fast());
        let mut texts: Vec<String> = TEXTS.iter().map(|t| t.to_string()).collect();
        texts.extend(
            (0..2_000).map(|_| (0..next() % 40).map(|_| pieces[(next() % pieces.len() as u64) as usize]).collect()),
        );
        for t in &texts {
            assert_eq!(tok.encode(t).expect("fast"), tok.encode_hf(t).expect("hf"), "{t:?}");
        }
    }
}
