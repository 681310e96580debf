//! Connection management over a small exchange on a data-plane connection (what `rdma_cm`
//! would do), inside the data plane's mutual TLS (`crate::secure`): the sender sends its queue
//! pair endpoint and the key of a room the receiver has open for it (the room id and its
//! secret, handed out over the daemons' mutual TLS), the receiver checks the key and only then
//! answers with its own endpoint and the page arena's address and shape. A peer without a live
//! room's key gets no queue pair, and one key opens one exchange.
//!
//! The arena's own remote key grants nothing: a sender asks, on the same connection, for each
//! room's **grant** ([`ask_grant`]) — with the room's key, once per room — and the receiver
//! binds a memory window over each run of the room's pages on that queue pair and answers,
//! naming the room, with their keys ([`Window`]). A write outside them fails the queue pair; the windows are
//! invalidated when the room ends or closes. The connection stays open for the life of the
//! queue pair: its closing is how each side learns the other is gone.

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use ferry_core::{Room, RoomSecret};

use super::verbs::{ENDPOINT_LEN, QpEndpoint};
use crate::secure::DataStream;

const MAGIC: [u8; 4] = *b"FRDM";
const VERSION: u16 = 3;

/// The receiver's page region, as its peers write into it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemoteRegion {
    /// Address of page 0.
    pub base: u64,
    /// Bytes per page.
    pub page_bytes: u64,
    /// Pages.
    pub pages: u64,
    /// Bytes of one control message the receiver's RECVs can hold.
    pub msg_bytes: u32,
}

const HEAD_LEN: usize = 4 + 2 + ENDPOINT_LEN;
const HELLO_LEN: usize = HEAD_LEN + 8 + 16;
const REPLY_LEN: usize = HEAD_LEN + 8 + 8 + 8 + 4;

fn bad(what: &str) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidData, format!("rdma connection setup: {what}"))
}

fn head(ep: &QpEndpoint) -> Vec<u8> {
    let mut b = Vec::with_capacity(REPLY_LEN);
    b.extend_from_slice(&MAGIC);
    b.extend_from_slice(&VERSION.to_le_bytes());
    b.extend_from_slice(&ep.encode());
    b
}

fn parse_head(b: &[u8]) -> std::io::Result<QpEndpoint> {
    if b[0..4] != MAGIC {
        return Err(bad("not a Ferry RDMA peer"));
    }
    if u16::from_le_bytes([b[4], b[5]]) != VERSION {
        return Err(bad("protocol version mismatch"));
    }
    let mut ep = [0u8; ENDPOINT_LEN];
    ep.copy_from_slice(&b[6..6 + ENDPOINT_LEN]);
    Ok(QpEndpoint::decode(&ep))
}

/// Sender side: sends our endpoint and the key of a room open on the receiver; returns the
/// receiver's endpoint and region (a receiver that refuses the key closes the connection).
pub async fn hello(
    stream: &mut DataStream,
    ours: &QpEndpoint,
    room: Room,
    secret: &RoomSecret,
) -> std::io::Result<(QpEndpoint, RemoteRegion)> {
    let mut h = head(ours);
    h.extend_from_slice(&room.get().to_le_bytes());
    h.extend_from_slice(secret.as_bytes());
    stream.write_all(&h).await?;
    stream.flush().await?;
    let mut b = [0u8; REPLY_LEN];
    stream.read_exact(&mut b).await.map_err(|e| match e.kind() {
        std::io::ErrorKind::UnexpectedEof => bad(&format!("the receiver refused the key of {room}")),
        _ => e,
    })?;
    let peer = parse_head(&b)?;
    let at = HEAD_LEN;
    let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().unwrap_or([0; 8]));
    let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().unwrap_or([0; 4]));
    let region = RemoteRegion {
        base: u64_at(at),
        page_bytes: u64_at(at + 8),
        pages: u64_at(at + 16),
        msg_bytes: u32_at(at + 24),
    };
    Ok((peer, region))
}

/// Receiver side: reads the sender's endpoint and the room key it shows (the id is not yet
/// checked to be a room: the caller checks the key against its table).
pub async fn read_hello(stream: &mut DataStream) -> std::io::Result<(QpEndpoint, Room, RoomSecret)> {
    let mut b = [0u8; HELLO_LEN];
    // The head first: a peer of another protocol version learns so at once (its hello may be
    // shorter), instead of waiting for bytes that never come.
    stream.read_exact(&mut b[..HEAD_LEN]).await?;
    let ep = parse_head(&b)?;
    stream.read_exact(&mut b[HEAD_LEN..]).await?;
    let id = u64::from_le_bytes(b[HEAD_LEN..HEAD_LEN + 8].try_into().unwrap_or([0; 8]));
    let room = Room::new(id).ok_or_else(|| bad("room id out of range"))?;
    let mut secret = [0u8; 16];
    secret.copy_from_slice(&b[HEAD_LEN + 8..HELLO_LEN]);
    Ok((ep, room, RoomSecret::from_bytes(secret)))
}

/// Receiver side: answers with our endpoint and region.
pub async fn reply(stream: &mut DataStream, ours: &QpEndpoint, region: &RemoteRegion) -> std::io::Result<()> {
    let mut b = head(ours);
    b.extend_from_slice(&region.base.to_le_bytes());
    b.extend_from_slice(&region.page_bytes.to_le_bytes());
    b.extend_from_slice(&region.pages.to_le_bytes());
    b.extend_from_slice(&region.msg_bytes.to_le_bytes());
    stream.write_all(&b).await?;
    stream.flush().await
}

/// A memory window over consecutive pages of one room, writable by one queue pair's peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Window {
    /// Its first page.
    pub first: u32,
    /// Pages it covers.
    pub pages: u32,
    /// Its remote key.
    pub rkey: u32,
}

impl Window {
    /// Whether pages `dst..dst + n` lie inside it.
    pub fn covers(&self, dst: u32, n: u32) -> bool {
        dst >= self.first && u64::from(dst) + u64::from(n) <= u64::from(self.first) + u64::from(self.pages)
    }
}

/// Bytes of a grant request: the room id and its secret.
pub const GRANT_REQUEST_LEN: usize = 8 + 16;
/// Most windows one grant carries (a room of that many separate runs is refused).
pub const MAX_WINDOWS: usize = 4096;

/// The maximal runs of consecutive pages in `pages` (sorted, distinct): `(first, len)`.
pub fn page_runs(pages: &[u32]) -> Vec<(u32, u32)> {
    let mut runs: Vec<(u32, u32)> = Vec::new();
    for &p in pages {
        match runs.last_mut() {
            Some((first, len)) if u64::from(*first) + u64::from(*len) == u64::from(p) => *len += 1,
            _ => runs.push((p, 1)),
        }
    }
    runs
}

/// Sender side: asks for `room`'s windows on this queue pair (showing the room's key); the
/// receiver answers with them, or refuses (an unknown room, a wrong secret, a room already
/// granted or under way).
pub async fn ask_grant(stream: &mut DataStream, room: Room, secret: &RoomSecret) -> std::io::Result<Vec<Window>> {
    let mut q = [0u8; GRANT_REQUEST_LEN];
    q[..8].copy_from_slice(&room.get().to_le_bytes());
    q[8..].copy_from_slice(secret.as_bytes());
    stream.write_all(&q).await?;
    stream.flush().await?;
    let mut head = [0u8; 13];
    stream.read_exact(&mut head).await?;
    let echo = u64::from_le_bytes(head[1..9].try_into().unwrap_or([0; 8]));
    if echo != room.get() {
        return Err(bad(&format!("a grant for {echo:#x} answered the request for {room}")));
    }
    let n = u32::from_le_bytes([head[9], head[10], head[11], head[12]]) as usize;
    if head[0] != 0 {
        return Err(std::io::Error::new(
            std::io::ErrorKind::PermissionDenied,
            format!("the receiver refused to grant {room}'s pages"),
        ));
    }
    if n > MAX_WINDOWS {
        return Err(bad("too many windows in a grant"));
    }
    let mut b = vec![0u8; n * 12];
    stream.read_exact(&mut b).await?;
    let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
    Ok((0..n).map(|i| Window { first: u32_at(i * 12), pages: u32_at(i * 12 + 4), rkey: u32_at(i * 12 + 8) }).collect())
}

/// Receiver side: the room and key of a grant request.
pub fn parse_grant_request(q: &[u8; GRANT_REQUEST_LEN]) -> std::io::Result<(Room, RoomSecret)> {
    let id = u64::from_le_bytes(q[..8].try_into().unwrap_or([0; 8]));
    let room = Room::new(id).ok_or_else(|| bad("room id out of range"))?;
    let mut secret = [0u8; 16];
    secret.copy_from_slice(&q[8..]);
    Ok((room, RoomSecret::from_bytes(secret)))
}

/// Receiver side: answers the grant request for `room` with `windows`, or with a refusal
/// (None). The answer names the room, so a sender never takes one room's keys for another's.
pub async fn grant(stream: &mut DataStream, room: Room, windows: Option<&[Window]>) -> std::io::Result<()> {
    let ws = windows.unwrap_or(&[]);
    let mut b = Vec::with_capacity(13 + ws.len() * 12);
    b.push(u8::from(windows.is_none()));
    b.extend_from_slice(&room.get().to_le_bytes());
    b.extend_from_slice(&(ws.len() as u32).to_le_bytes());
    for w in ws {
        b.extend_from_slice(&w.first.to_le_bytes());
        b.extend_from_slice(&w.pages.to_le_bytes());
        b.extend_from_slice(&w.rkey.to_le_bytes());
    }
    stream.write_all(&b).await?;
    stream.flush().await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn page_runs_are_maximal() {
        assert_eq!(page_runs(&[]), vec![]);
        assert_eq!(page_runs(&[3, 4, 5, 9, 11, 12]), vec![(3, 3), (9, 1), (11, 2)]);
        assert_eq!(page_runs(&[u32::MAX - 1, u32::MAX]), vec![(u32::MAX - 1, 2)]);
        let w = Window { first: 3, pages: 3, rkey: 1 };
        assert!(w.covers(3, 3) && w.covers(4, 2) && !w.covers(2, 1) && !w.covers(5, 2) && !w.covers(u32::MAX, 2));
    }
}
