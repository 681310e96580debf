//! Connection management over a small TCP exchange (what `rdma_cm` would do): the sender
//! sends its queue pair endpoint and the key of a room the receiver has open for it (the room
//! id and its secret, handed out over the daemons' mutual TLS), the receiver checks the key
//! and only then answers with its own endpoint and the registered page region. A peer without
//! a live room's key gets no queue pair, no address and no remote key, and one key opens one
//! exchange. The data plane is not encrypted: someone who can observe it learns the keys that
//! cross it (here and in every frame header). The TCP
//! connection then stays open for the life of the queue pair: its closing is how each side
//! learns the other is gone.

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use ferry_core::{Room, RoomSecret};

use super::verbs::{ENDPOINT_LEN, QpEndpoint};
use crate::secure::DataStream;

const MAGIC: [u8; 4] = *b"FRDM";
const VERSION: u16 = 2;

/// The receiver's page region, as its peers write into it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemoteRegion {
    /// Address of page 0.
    pub base: u64,
    /// Remote key.
    pub rkey: u32,
    /// Bytes per page.
    pub page_bytes: u64,
    /// Pages.
    pub pages: u64,
    /// Bytes of one control message the receiver's RECVs can hold.
    pub msg_bytes: u32,
}

const HEAD_LEN: usize = 4 + 2 + ENDPOINT_LEN;
const HELLO_LEN: usize = HEAD_LEN + 8 + 16;
const REPLY_LEN: usize = HEAD_LEN + 8 + 4 + 8 + 8 + 4;

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
        rkey: u32_at(at + 8),
        page_bytes: u64_at(at + 12),
        pages: u64_at(at + 20),
        msg_bytes: u32_at(at + 28),
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
    b.extend_from_slice(&region.rkey.to_le_bytes());
    b.extend_from_slice(&region.page_bytes.to_le_bytes());
    b.extend_from_slice(&region.pages.to_le_bytes());
    b.extend_from_slice(&region.msg_bytes.to_le_bytes());
    stream.write_all(&b).await?;
    stream.flush().await
}
