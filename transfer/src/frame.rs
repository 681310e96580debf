//! Data-plane frames: a fixed 52-byte header, then the payload.
//!
//! ```text
//! magic u32 "FRY1" | kind u8 | flags u8 (0) | reserved u16 (0) | room u64 | secret [16]
//! | dst_page u32 | n_pages u32 | payload_len u32 | payload_crc32c u32 | header_crc32c u32
//! ```
//! All little-endian. `header_crc32c` covers the 48 bytes before it, so a corrupted length or
//! page number is caught before any byte of payload is placed. Kinds: `Pages` (a run of
//! `n_pages` whole pages for destination pages `dst_page..`), `Done` (the last message of a
//! room: the aux data), `Abort` (a reason text). The decoder is total: any 52 bytes give a
//! header or an error, never a panic, and lengths are bounded by [`Limits`]. A room id over
//! 63 bits is refused: the header decodes into a [`Room`].

use ferry_core::{Room, RoomSecret};

/// Header size in bytes.
pub const HEADER_LEN: usize = 52;
const MAGIC: u32 = u32::from_le_bytes(*b"FRY1");

/// What a frame carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Page data for a run of destination pages.
    Pages = 1,
    /// The room's last message: aux data.
    Done = 2,
    /// The sender gave up on the room; the payload is a UTF-8 reason.
    Abort = 3,
}

/// A decoded header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// Frame kind.
    pub kind: Kind,
    /// Room id.
    pub room: Room,
    /// Room secret.
    pub secret: RoomSecret,
    /// First destination page (`Pages`).
    pub dst_page: u32,
    /// Pages in the run (`Pages`).
    pub n_pages: u32,
    /// Payload bytes after the header.
    pub payload_len: u32,
    /// CRC32C of the payload.
    pub payload_crc: u32,
}

/// Bounds the decoder enforces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Bytes in one page (all layers, K and V).
    pub page_bytes: u32,
    /// Largest payload accepted in one frame.
    pub max_payload: u32,
}

/// Largest `Done` or `Abort` payload.
pub const MAX_SMALL_PAYLOAD: u32 = 4096;

/// Why a header was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    /// Not a Ferry frame (or the stream lost its framing).
    #[error("bad magic {0:#010x}")]
    BadMagic(u32),
    /// The header's own checksum does not match.
    #[error("header checksum mismatch")]
    HeaderCrc,
    /// Unknown kind byte.
    #[error("unknown frame kind {0}")]
    UnknownKind(u8),
    /// Flags or reserved bits set.
    #[error("reserved header bits set")]
    Reserved,
    /// A room id over 63 bits (no router mints one).
    #[error("room id {0:#x} is over 63 bits")]
    BadRoom(u64),
    /// The payload length does not fit the kind or the limits.
    #[error("bad payload length {len} for {kind:?}: {why}")]
    Length {
        /// Frame kind.
        kind: Kind,
        /// Length given.
        len: u32,
        /// The rule broken.
        why: &'static str,
    },
    /// The payload does not match its checksum.
    #[error("payload checksum mismatch")]
    PayloadCrc,
}

impl Header {
    /// A `Pages` header for `payload`.
    pub fn pages(room: Room, secret: RoomSecret, dst_page: u32, n_pages: u32, payload: &[u8]) -> Self {
        Self::with(Kind::Pages, room, secret, dst_page, n_pages, payload)
    }

    /// A header of `kind` for `payload`.
    pub fn with(kind: Kind, room: Room, secret: RoomSecret, dst_page: u32, n_pages: u32, payload: &[u8]) -> Self {
        Self {
            kind,
            room,
            secret,
            dst_page,
            n_pages,
            payload_len: payload.len() as u32,
            payload_crc: crc32c::crc32c(payload),
        }
    }

    /// Encodes the header.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        b[4] = self.kind as u8;
        b[8..16].copy_from_slice(&self.room.get().to_le_bytes());
        b[16..32].copy_from_slice(self.secret.as_bytes());
        b[32..36].copy_from_slice(&self.dst_page.to_le_bytes());
        b[36..40].copy_from_slice(&self.n_pages.to_le_bytes());
        b[40..44].copy_from_slice(&self.payload_len.to_le_bytes());
        b[44..48].copy_from_slice(&self.payload_crc.to_le_bytes());
        let crc = crc32c::crc32c(&b[..48]);
        b[48..52].copy_from_slice(&crc.to_le_bytes());
        b
    }

    /// Decodes and checks a header against `limits`.
    pub fn decode(b: &[u8; HEADER_LEN], limits: &Limits) -> Result<Self, FrameError> {
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let magic = u32_at(0);
        if magic != MAGIC {
            return Err(FrameError::BadMagic(magic));
        }
        if crc32c::crc32c(&b[..48]) != u32_at(48) {
            return Err(FrameError::HeaderCrc);
        }
        let kind = match b[4] {
            1 => Kind::Pages,
            2 => Kind::Done,
            3 => Kind::Abort,
            k => return Err(FrameError::UnknownKind(k)),
        };
        if b[5] != 0 || b[6] != 0 || b[7] != 0 {
            return Err(FrameError::Reserved);
        }
        let mut room = [0u8; 8];
        room.copy_from_slice(&b[8..16]);
        let mut secret = [0u8; 16];
        secret.copy_from_slice(&b[16..32]);
        let room = u64::from_le_bytes(room);
        let h = Self {
            kind,
            room: Room::new(room).ok_or(FrameError::BadRoom(room))?,
            secret: RoomSecret::from_bytes(secret),
            dst_page: u32_at(32),
            n_pages: u32_at(36),
            payload_len: u32_at(40),
            payload_crc: u32_at(44),
        };
        let len = h.payload_len;
        let bad = |why| Err(FrameError::Length { kind, len, why });
        match kind {
            Kind::Pages => {
                if h.n_pages == 0 {
                    return bad("a page run has at least one page");
                }
                if u64::from(h.n_pages) * u64::from(limits.page_bytes) != u64::from(len) {
                    return bad("not n_pages whole pages");
                }
                if len > limits.max_payload {
                    return bad("over the frame size limit");
                }
            }
            Kind::Done | Kind::Abort => {
                if len > MAX_SMALL_PAYLOAD {
                    return bad("over 4096 bytes");
                }
            }
        }
        Ok(h)
    }

    /// Checks `payload` against the header's checksum.
    pub fn check_payload(&self, payload: &[u8]) -> Result<(), FrameError> {
        if payload.len() != self.payload_len as usize || crc32c::crc32c(payload) != self.payload_crc {
            return Err(FrameError::PayloadCrc);
        }
        Ok(())
    }
}

/// The aux data of a room's `Done` frame.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Aux {
    /// The first sampled token.
    pub first_token: u32,
    /// Its log probability.
    pub logprob: f32,
    /// The room, echoed.
    pub room_echo: u64,
    /// Pages sent in the whole room, for the receiver's accounting.
    pub total_pages: u32,
}

/// Encoded size of [`Aux`].
pub const AUX_LEN: usize = 20;

impl Aux {
    /// Encodes the aux data.
    pub fn encode(&self) -> [u8; AUX_LEN] {
        let mut b = [0u8; AUX_LEN];
        b[0..4].copy_from_slice(&self.first_token.to_le_bytes());
        b[4..8].copy_from_slice(&self.logprob.to_le_bytes());
        b[8..16].copy_from_slice(&self.room_echo.to_le_bytes());
        b[16..20].copy_from_slice(&self.total_pages.to_le_bytes());
        b
    }

    /// Decodes aux data; None when the length is wrong.
    pub fn decode(b: &[u8]) -> Option<Self> {
        let b: &[u8; AUX_LEN] = b.try_into().ok()?;
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let mut room = [0u8; 8];
        room.copy_from_slice(&b[8..16]);
        Some(Self {
            first_token: u32_at(0),
            logprob: f32::from_bits(u32_at(4)),
            room_echo: u64::from_le_bytes(room),
            total_pages: u32_at(16),
        })
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    const LIMITS: Limits = Limits { page_bytes: 64, max_payload: 64 * 16 };

    #[test]
    fn headers_round_trip_and_checks_fire() {
        let payload = vec![7u8; 128];
        let h = Header::pages(Room::from(42u32), RoomSecret::from([9; 16]), 3, 2, &payload);
        let b = h.encode();
        assert_eq!(Header::decode(&b, &LIMITS), Ok(h));
        assert_eq!(h.check_payload(&payload), Ok(()));
        let mut corrupt = payload.clone();
        corrupt[5] ^= 1;
        assert_eq!(h.check_payload(&corrupt), Err(FrameError::PayloadCrc));
        let wrong_len = Header::pages(Room::from(42u32), RoomSecret::from([9; 16]), 3, 3, &payload).encode();
        assert!(matches!(Header::decode(&wrong_len, &LIMITS), Err(FrameError::Length { .. })));
        let big = vec![0u8; 64 * 17];
        let too_big = Header::pages(Room::from(1u32), RoomSecret::from([0; 16]), 0, 17, &big).encode();
        assert!(matches!(
            Header::decode(&too_big, &LIMITS),
            Err(FrameError::Length { why: "over the frame size limit", .. })
        ));
        let mut flipped = b;
        flipped[33] ^= 0x80; // dst_page
        assert_eq!(Header::decode(&flipped, &LIMITS), Err(FrameError::HeaderCrc));
        // A room id over 63 bits is refused even with a valid checksum.
        let mut wide = b;
        wide[15] |= 0x80;
        let crc = crc32c::crc32c(&wide[..48]);
        wide[48..52].copy_from_slice(&crc.to_le_bytes());
        assert!(matches!(Header::decode(&wide, &LIMITS), Err(FrameError::BadRoom(_))));
        let aux = Aux { first_token: 17, logprob: -0.5, room_echo: 42, total_pages: 9 };
        assert_eq!(Aux::decode(&aux.encode()), Some(aux));
        assert_eq!(Aux::decode(&[0; 3]), None);
    }

    proptest! {
        #[test]
        fn any_bytes_decode_without_panicking(bytes in proptest::collection::vec(any::<u8>(), HEADER_LEN)) {
            let mut b = [0u8; HEADER_LEN];
            b.copy_from_slice(&bytes);
            let _ = Header::decode(&b, &LIMITS);
            // With a valid magic and checksum, random fields still cannot get past the bounds.
            b[0..4].copy_from_slice(&MAGIC.to_le_bytes());
            let crc = crc32c::crc32c(&b[..48]);
            b[48..52].copy_from_slice(&crc.to_le_bytes());
            if let Ok(h) = Header::decode(&b, &LIMITS) {
                prop_assert!(h.payload_len <= LIMITS.max_payload.max(MAX_SMALL_PAYLOAD));
            }
        }
    }
}
