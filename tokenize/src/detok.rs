//! Incremental detokenization that never emits half a UTF-8 character.
//!
//! Byte-level tokenizers split characters across tokens; decoding a token alone can end in
//! an incomplete character, which `tokenizers` renders as U+FFFD. The detokenizer decodes a
//! small window of recent tokens and emits only the new text once it no longer ends in an
//! incomplete character (the prefix/read offset scheme of text-generation-inference).
//!
//! A byte-level vocabulary (a `ByteLevel` decoder) needs no window: each id's bytes come from
//! a table (`byte_decode`), and the text is emitted up to the last complete character, an
//! invalid sequence as U+FFFD — piece by piece exactly HF's lossy decoding of all the ids.

use crate::{TokenizeError, Tokenizer};

/// Turns a stream of token ids into a stream of text pieces.
#[derive(Debug, Clone, Default)]
pub struct Detokenizer {
    ids: Vec<u32>,
    prefix_offset: usize,
    read_offset: usize,
    skip_special: bool,
    /// Byte-level: bytes not yet emitted (the start of a character).
    pending: Vec<u8>,
}

impl Detokenizer {
    /// A detokenizer; special tokens are dropped from the text when `skip_special`.
    pub fn new(skip_special: bool) -> Self {
        Self { skip_special, ..Self::default() }
    }

    /// Adds one token; returns the text it completes (possibly empty).
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> Result<String, TokenizeError> {
        if let Some(bytes) = tok.byte_decoder() {
            bytes.append(id, self.skip_special, &mut self.pending);
            return Ok(self.complete());
        }
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
        if tok.byte_decoder().is_some() {
            let rest = String::from_utf8_lossy(&self.pending).into_owned();
            self.pending.clear();
            return Ok(rest);
        }
        let prefix = tok.decode(&self.ids[self.prefix_offset..self.read_offset], self.skip_special)?;
        let full = tok.decode(&self.ids[self.prefix_offset..], self.skip_special)?;
        self.prefix_offset = self.ids.len();
        self.read_offset = self.ids.len();
        Ok(full.get(prefix.len()..).unwrap_or_default().to_string())
    }

    /// The pending bytes up to the last complete character (an invalid sequence as U+FFFD,
    /// as `String::from_utf8_lossy` writes it); an incomplete character at the end stays.
    fn complete(&mut self) -> String {
        let mut out = String::new();
        let mut at = 0;
        loop {
            match std::str::from_utf8(&self.pending[at..]) {
                Ok(s) => {
                    out.push_str(s);
                    at = self.pending.len();
                    break;
                }
                Err(e) => {
                    let valid = at + e.valid_up_to();
                    // Checked valid just now.
                    out.push_str(std::str::from_utf8(&self.pending[at..valid]).unwrap_or_default());
                    match e.error_len() {
                        Some(n) => {
                            out.push('\u{FFFD}');
                            at = valid + n;
                        }
                        None => {
                            at = valid;
                            break;
                        }
                    }
                }
            }
        }
        self.pending.drain(..at);
        out
    }
}
