//! Incremental detokenization that never emits half a UTF-8 character.
//!
//! Byte-level tokenizers split characters across tokens; decoding a token alone can end in
//! an incomplete character, which `tokenizers` renders as U+FFFD. The detokenizer decodes a
//! small window of recent tokens and emits only the new text once it no longer ends in an
//! incomplete character (the prefix/read offset scheme of text-generation-inference).

use crate::{TokenizeError, Tokenizer};

/// Turns a stream of token ids into a stream of text pieces.
#[derive(Debug, Clone, Default)]
pub struct Detokenizer {
    ids: Vec<u32>,
    prefix_offset: usize,
    read_offset: usize,
    skip_special: bool,
}

impl Detokenizer {
    /// A detokenizer; special tokens are dropped from the text when `skip_special`.
    pub fn new(skip_special: bool) -> Self {
        Self { skip_special, ..Self::default() }
    }

    /// Adds one token; returns the text it completes (possibly empty).
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> Result<String, TokenizeError> {
        self.ids.push(id);
        let prefix = tok.decode(&self.ids[self.prefix_offset..self.read_offset], self.skip_special)?;
        let full = tok.decode(&self.ids[self.prefix_offset..], self.skip_special)?;
        if full.len() > prefix.len() && !full.ends_with('\u{FFFD}') && full.is_char_boundary(prefix.len()) {
            let new = full[prefix.len()..].to_string();
            self.prefix_offset = self.read_offset;
            self.read_offset = self.ids.len();
            Ok(new)
        } else {
            Ok(String::new())
        }
    }

    /// Whatever text is still held back (an incomplete character at the very end).
    pub fn flush(&mut self, tok: &Tokenizer) -> Result<String, TokenizeError> {
        let prefix = tok.decode(&self.ids[self.prefix_offset..self.read_offset], self.skip_special)?;
        let full = tok.decode(&self.ids[self.prefix_offset..], self.skip_special)?;
        self.prefix_offset = self.ids.len();
        self.read_offset = self.ids.len();
        Ok(full.get(prefix.len()..).unwrap_or_default().to_string())
    }
}
