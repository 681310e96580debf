//! A handshake address that accepts and never answers (issue 21): a direct caller names, as
//! the prefill bootstrap address of its Decode call, a port whose owner accepts connections
//! and then says nothing — no TLS, no HTTP/2, no FIN. The decode worker must end that request
//! within its handshake timeout with a clear status, while its other rooms go on.

use std::time::{Duration, Instant};

use ferry_cluster::RoomKey;
use ferry_proto::v1 as pb;

/// What the call to the decode worker got, and when.
#[derive(Debug)]
pub struct BlackHole {
    /// From the call to its end.
    pub took: Duration,
    /// Its status (None: it ended without one, which must not happen).
    pub status: Option<tonic::Status>,
}

/// Sends one request to the decode worker at `decode` whose bootstrap address is a black
/// hole; gives up after `within`.
pub async fn run(decode: &str, prompt: &[u32], within: Duration) -> BlackHole {
    let hole = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind the black hole");
    let addr = hole.local_addr().expect("addr").to_string();
    let held = tokio::spawn(async move {
        let mut conns = Vec::new();
        while let Ok((c, _)) = hole.accept().await {
            conns.push(c); // kept open, never read or written
        }
    });
    let mut d = pb::decode_client::DecodeClient::new(ferry_tests::channel(decode.parse().expect("addr")).await);
    let req = pb::DecodeRequest {
        request_id: "black-hole".into(),
        room: Some(ferry_cluster::wire::room_key_to_proto(&RoomKey::random())),
        prefill_bootstrap_addr: addr,
        token_ids: prompt.to_vec(),
        sampling: Some(ferry_cluster::wire::sampling_to_proto(&ferry_tests::greedy(4))),
    };
    let t = Instant::now();
    let call = async {
        let mut s = d.generate(req).await?.into_inner();
        while s.message().await?.is_some() {}
        Ok::<(), tonic::Status>(())
    };
    let status = match tokio::time::timeout(within, call).await {
        Ok(Err(s)) => Some(s),
        Ok(Ok(())) | Err(_) => None,
    };
    held.abort();
    BlackHole { took: t.elapsed(), status }
}
