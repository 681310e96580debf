//! The raw bytes of one token, as OpenAI's logprobs report them (`bytes`, and the `token`
//! string): byte-level BPE vocabularies write each byte as a printable character (GPT-2's
//! table), SentencePiece ones write a space as `▁` and unknown bytes as `<0xNN>`.

use std::collections::HashMap;
use std::sync::LazyLock;

/// GPT-2's byte-to-character table: printable bytes stand for themselves, the others for
/// characters from U+0100 on.
pub(crate) fn byte_chars() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut next = 256u32;
    for b in 0..=255u8 {
        let printable = matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        table[b as usize] = if printable {
            b as char
        } else {
            let c = char::from_u32(next).unwrap_or('\0');
            next += 1;
            c
        };
    }
    table
}

/// GPT-2's byte → character table, inverted: the byte a vocabulary character stands for.
pub(crate) fn byte_level_byte(c: char) -> Option<u8> {
    static BYTES: LazyLock<HashMap<char, u8>> =
        LazyLock::new(|| byte_chars().iter().enumerate().map(|(b, c)| (*c, b as u8)).collect());
    BYTES.get(&c).copied()
}

/// The bytes of a SentencePiece piece: `<0xNN>` is that byte; `▁` is a space.
pub(crate) fn sentencepiece_bytes(piece: &str) -> Vec<u8> {
    if let Some(h) = piece.strip_prefix("<0x").and_then(|t| t.strip_suffix('>'))
        && h.len() == 2
        && let Ok(b) = u8::from_str_radix(h, 16)
    {
        return vec![b];
    }
    piece.replace('\u{2581}', " ").into_bytes()
}

/// A token's display string: its text when its bytes are UTF-8, else OpenAI's
/// `bytes:\xNN...` form (a token that is part of a character).
pub fn display(bytes: &[u8]) -> String {
    match std::str::from_utf8(bytes) {
        Ok(s) => s.to_string(),
        Err(_) => {
            let mut s = String::from("bytes:");
            for b in bytes {
                s.push_str(&format!("\\x{b:02x}"));
            }
            s
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_level_characters_map_back_to_their_bytes() {
        assert_eq!(byte_level_byte('a'), Some(b'a'));
        assert_eq!(byte_level_byte('Ġ'), Some(b' '), "U+0120 is the space");
        assert_eq!(byte_level_byte('Ċ'), Some(b'\n'), "U+010A is the newline");
        assert_eq!(byte_level_byte('\u{100}'), Some(0));
        assert_eq!(byte_level_byte('é'), Some(0xe9));
        assert_eq!(byte_level_byte('\u{5000}'), None);
        // Every byte has exactly one character.
        let mut seen = [false; 256];
        for n in 0..=0x1ffu32 {
            if let Some(b) = char::from_u32(n).and_then(byte_level_byte) {
                assert!(!seen[b as usize], "byte {b} twice");
                seen[b as usize] = true;
            }
        }
        assert!(seen.iter().all(|&s| s));
    }

    #[test]
    fn sentencepiece_pieces_and_partial_characters() {
        assert_eq!(sentencepiece_bytes("▁Hello"), b" Hello");
        assert_eq!(sentencepiece_bytes("<0x0A>"), b"\n");
        assert_eq!(display(b" Hello"), " Hello");
        assert_eq!(display(&[0xe2, 0x80]), "bytes:\\xe2\\x80");
    }
}
