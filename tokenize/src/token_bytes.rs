//! The raw bytes of one token, as OpenAI's logprobs report them (`bytes`, and the `token`
//! string): byte-level BPE vocabularies write each byte as a printable character (GPT-2's
//! table), SentencePiece ones write a space as `▁` and unknown bytes as `<0xNN>`.

/// GPT-2's byte → character table, inverted: the byte a vocabulary character stands for.
pub(crate) fn byte_level_byte(c: char) -> Option<u8> {
    let printable = |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
    let n = c as u32;
    if n < 256 && printable(n) {
        return Some(n as u8);
    }
    // The other bytes, in order, are written as U+0100, U+0101, ...
    let k = n.checked_sub(256)? as usize;
    (0u32..256).filter(|&b| !printable(b)).nth(k).map(|b| b as u8)
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
