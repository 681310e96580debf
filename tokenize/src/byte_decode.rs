//! Decoding for byte-level BPE without HF's pipeline: each id's bytes looked up in a table
//! built once, as HF's `decode` with a `ByteLevel` decoder makes them — the token's string
//! (an added token's content first, else the model's), each character mapped back through
//! GPT-2's byte table, or the string's own UTF-8 where a character is not in the table; a
//! special token left out when asked; ids without a token dropped. HF then reads the bytes
//! of all ids as UTF-8, lossily; [`crate::Detokenizer`] does the same piece by piece.
//!
//! HF's `decode` builds a string per id and a vector per call: on the router that was ~13 µs
//! of an 8-token answer, decoded twice per token by the detokenizer's window.

use crate::token_bytes::byte_level_byte;

/// Every id's bytes, and whether it is a special token.
pub(crate) struct ByteDecoder {
    bytes: Vec<Box<[u8]>>,
    special: Vec<bool>,
}

impl std::fmt::Debug for ByteDecoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ByteDecoder").field("ids", &self.bytes.len()).finish()
    }
}

impl ByteDecoder {
    /// The table for `tok`; `None` unless its decoder is exactly `ByteLevel`.
    pub(crate) fn new(tok: &tokenizers::Tokenizer) -> Option<Self> {
        if !matches!(tok.get_decoder(), Some(tokenizers::DecoderWrapper::ByteLevel(_))) {
            return None;
        }
        let n = tok.get_vocab(true).values().max().map_or(0, |&m| m as usize + 1);
        let added = tok.get_added_vocabulary();
        let (mut bytes, mut special) = (Vec::with_capacity(n), Vec::with_capacity(n));
        for id in 0..n as u32 {
            // An id without a token decodes to nothing.
            let token = tok.id_to_token(id).unwrap_or_default();
            let mapped: Option<Vec<u8>> = token.chars().map(byte_level_byte).collect();
            bytes.push(mapped.unwrap_or_else(|| token.as_bytes().to_vec()).into_boxed_slice());
            special.push(added.is_special_token(&token));
        }
        Some(Self { bytes, special })
    }

    /// Appends the bytes of `id` to `out` (nothing for a special token when `skip_special`,
    /// nor for an id without a token).
    pub(crate) fn append(&self, id: u32, skip_special: bool, out: &mut Vec<u8>) {
        let i = id as usize;
        if i < self.bytes.len() && !(skip_special && self.special[i]) {
            out.extend_from_slice(&self.bytes[i]);
        }
    }
}
