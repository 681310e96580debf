//! Identities, as newtypes so that a room id is never mistaken for a page count.

use std::fmt;

use rand::Rng;

/// A transfer room: a random 63-bit id minted by the router for one request's KV transfer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Room(u64);

impl Room {
    /// Largest valid room id (63 bits).
    pub const MAX: u64 = (1 << 63) - 1;

    /// A room from its id, or None when it does not fit in 63 bits.
    pub fn new(id: u64) -> Option<Self> {
        (id <= Self::MAX).then_some(Self(id))
    }

    /// A fresh random room.
    pub fn random() -> Self {
        Self(rand::rng().random::<u64>() & Self::MAX)
    }

    /// The id.
    pub fn get(self) -> u64 {
        self.0
    }
}

/// Every 32-bit id is a room id (tests and tools name rooms by small numbers).
impl From<u32> for Room {
    fn from(id: u32) -> Self {
        Self(u64::from(id))
    }
}

impl fmt::Display for Room {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "room-{:016x}", self.0)
    }
}

/// The 128-bit secret every message about a room must carry. Compared in constant time.
#[derive(Clone, Copy, Eq)]
pub struct RoomSecret([u8; 16]);

impl PartialEq for RoomSecret {
    fn eq(&self, other: &Self) -> bool {
        secret_eq(&self.0, &other.0)
    }
}

impl std::hash::Hash for RoomSecret {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.0.hash(state);
    }
}

/// Whether two secrets (room secrets, API keys) are equal, in time that depends on their
/// lengths only, not on where they differ: a caller timing refusals learns nothing of a key.
pub fn secret_eq(a: &[u8], b: &[u8]) -> bool {
    use subtle::ConstantTimeEq;
    a.ct_eq(b).into()
}

impl RoomSecret {
    /// A fresh random secret.
    pub fn random() -> Self {
        Self(rand::rng().random())
    }

    /// The secret from its bytes.
    pub fn from_bytes(b: [u8; 16]) -> Self {
        Self(b)
    }

    /// The bytes.
    pub fn as_bytes(&self) -> &[u8; 16] {
        &self.0
    }
}

impl From<[u8; 16]> for RoomSecret {
    fn from(b: [u8; 16]) -> Self {
        Self(b)
    }
}

impl fmt::Debug for RoomSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never print secrets.
        f.write_str("RoomSecret(..)")
    }
}

/// A KV page: its index in one node's page pool. Not a token, not a count.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PageId(pub u32);

impl PageId {
    /// The index.
    pub fn get(self) -> u32 {
        self.0
    }
}

impl fmt::Display for PageId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "page-{}", self.0)
    }
}

/// A room with its secret.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RoomKey {
    /// The room.
    pub room: Room,
    /// Its secret.
    pub secret: RoomSecret,
}

impl RoomKey {
    /// A fresh random room and secret.
    pub fn random() -> Self {
        Self { room: Room::random(), secret: RoomSecret::random() }
    }
}

/// A worker's identity in the cluster.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct WorkerId(String);

impl WorkerId {
    /// A worker id: 1 to 128 bytes, none of them `/` or `=` (an etcd key and a discovery
    /// entry split on them), whitespace or a control character; else None.
    pub fn new(id: impl Into<String>) -> Option<Self> {
        let id = id.into();
        let fits = !id.is_empty() && id.len() <= 128;
        (fits && !id.chars().any(|c| matches!(c, '/' | '=') || c.is_whitespace() || c.is_control())).then_some(Self(id))
    }

    /// The id a worker takes when given none: `<role>-<port>`.
    pub fn of(role: &str, port: u16) -> Self {
        Self(format!("{role}-{port}"))
    }

    /// The id.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for WorkerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A string that is not a worker id (see [`WorkerId::new`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BadWorkerId(String);

impl fmt::Display for BadWorkerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "worker id {:?}: 1 to 128 bytes, without '/', '=' or spaces", self.0)
    }
}

impl std::error::Error for BadWorkerId {}

impl std::str::FromStr for WorkerId {
    type Err = BadWorkerId;

    /// For flags (`--worker-id`) and discovery entries.
    fn from_str(s: &str) -> Result<Self, BadWorkerId> {
        Self::new(s).ok_or_else(|| BadWorkerId(s.to_string()))
    }
}

/// A worker id as a metric label value.
impl From<WorkerId> for metrics::SharedString {
    fn from(w: WorkerId) -> Self {
        w.0.into()
    }
}

impl PartialEq<str> for WorkerId {
    fn eq(&self, other: &str) -> bool {
        self.0 == other
    }
}

/// A client request's identity, echoed in logs and responses.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct RequestId(String);

impl RequestId {
    /// A request id (at most 256 bytes; longer ids are cut at a character boundary).
    pub fn new(id: impl Into<String>) -> Self {
        let mut id = id.into();
        if id.len() > 256 {
            let mut cut = 256;
            while !id.is_char_boundary(cut) {
                cut -= 1;
            }
            id.truncate(cut);
        }
        Self(id)
    }

    /// A fresh random id.
    pub fn random() -> Self {
        Self(format!("req-{:016x}", rand::rng().random::<u64>()))
    }

    /// The id.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for RequestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_compare_by_value() {
        assert!(secret_eq(b"key-1", b"key-1"));
        assert!(!secret_eq(b"key-1", b"key-2") && !secret_eq(b"key-1", b"key-12") && !secret_eq(b"", b"k"));
        let s = RoomSecret::random();
        assert_eq!(s, RoomSecret::from_bytes(*s.as_bytes()));
        let mut other = *s.as_bytes();
        other[15] ^= 1;
        assert_ne!(s, RoomSecret::from_bytes(other));
    }

    #[test]
    fn worker_ids_are_one_to_128_bytes() {
        assert_eq!("p0".parse::<WorkerId>().map(|w| w.to_string()), Ok("p0".to_string()));
        assert!("".parse::<WorkerId>().is_err() && "x".repeat(129).parse::<WorkerId>().is_err());
        for bad in ["a/b", "a=b", "a b", "a\nb"] {
            assert!(bad.parse::<WorkerId>().is_err(), "{bad:?}");
        }
        assert_eq!(WorkerId::of("decode", 7).as_str(), "decode-7");
        assert!(WorkerId::of("decode", 7) == *"decode-7");
    }
}
