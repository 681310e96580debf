//! The grammar engine's view of a Ferry tokenizer: every token's bytes (special tokens
//! marked, so no grammar text can produce them), the end-of-sequence ids, and a way to
//! tokenize bytes (for forced text).

use std::sync::Arc;

use ferry_tokenize::Tokenizer;
use toktrie::{TokEnv, TokRxInfo, TokTrie, TokenizerEnv};

use crate::GrammarError;

struct Env {
    tok: Tokenizer,
    trie: TokTrie,
}

impl TokenizerEnv for Env {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    /// The tokenizer's own ids for `s` when they spell exactly `s`; else the trie's greedy
    /// ones. The pipeline may add to a fragment: a SentencePiece tokenizer's `▁` before it,
    /// a special token where its text appears; forced text must be what the constraint
    /// forces, byte for byte.
    fn tokenize_bytes(&self, s: &[u8]) -> Vec<u32> {
        self.trie.tokenize_with_greedy_fallback(s, |text| {
            let ids = self.tok.encode_without_bos(text).unwrap_or_default();
            if self.trie.decode_raw(&ids) == text.as_bytes() { ids } else { self.trie.greedy_tokenize(text.as_bytes()) }
        })
    }
}

/// `tok`'s token table for llguidance. Tokens of the model's vocabulary past the
/// tokenizer's own are special (never allowed by a grammar).
pub fn tok_env(tok: &Tokenizer) -> Result<TokEnv, GrammarError> {
    let vocab = tok.vocab_size();
    let eos = tok.eos_ids();
    let Some(&first_eos) = eos.first() else {
        return Err(GrammarError::Unavailable("the model has no end-of-sequence token".into()));
    };
    let special: std::collections::HashSet<u32> = tok.special_ids().into_iter().collect();
    let marked = |name: &str| [&[TokTrie::SPECIAL_TOKEN_MARKER][..], name.as_bytes()].concat();
    let words: Vec<Vec<u8>> = (0..vocab as u32)
        .map(|id| match tok.id_to_token(id) {
            Some(name) if special.contains(&id) || eos.contains(&id) => marked(&name),
            Some(_) => tok.token_bytes(id),
            None => marked(&format!("<[{id}]>")),
        })
        .collect();
    let mut info = TokRxInfo::new(vocab as u32, first_eos);
    info.tok_bos = tok.bos_id();
    let mut trie = TokTrie::from(&info, &words);
    if eos.len() > 1 {
        trie = trie.with_eos_tokens(eos);
    }
    Ok(Arc::new(Env { tok: tok.clone(), trie }))
}
