//! A direct caller on the network reusing one room id (issue 21): it calls a decode and a
//! prefill worker itself — no router — with the same room id and secret over and over,
//! cancelling every other request mid-flight and sending the next at once, while that id's
//! earlier incarnation may still be computing, sending or closing on either side. Every call
//! must end with the reference tokens or a clear status, and nothing may leak.

use std::collections::BTreeMap;
use std::time::Duration;

use ferry_cluster::RoomKey;
use ferry_proto::v1 as pb;

/// One call must end within this.
const CALL_TIMEOUT: Duration = Duration::from_secs(30);

/// What the direct caller saw.
#[derive(Debug, Default)]
pub struct Reuse {
    /// Pairs of calls (decode and prefill) sent.
    pub sent: u64,
    /// Decode calls that streamed the reference tokens.
    pub completed: u64,
    /// Decode calls that streamed other tokens (must be 0).
    pub wrong: u64,
    /// Calls cancelled by the caller on purpose.
    pub cancelled: u64,
    /// Calls that ended with an error: `side: code (reason in the message)`, counted.
    pub errors: BTreeMap<String, u64>,
    /// Calls that did not end within [`CALL_TIMEOUT`] (must be 0).
    pub hung: u64,
}

impl Reuse {
    fn error(&mut self, side: &str, s: &tonic::Status) {
        let reason = s.message().split(':').next().unwrap_or_default().trim().to_string();
        *self.errors.entry(format!("{side}: {:?} ({reason})", s.code())).or_default() += 1;
    }

    /// A status a careful caller could not act on (an internal error, or none at all).
    pub fn unclear(&self) -> Vec<&String> {
        self.errors.keys().filter(|k| k.contains("Internal") || k.contains("Unknown")).collect()
    }
}

/// One pair of calls with `key`: the decode call's tokens, and the prefill call's outcome.
async fn pair(
    mut d: pb::decode_client::DecodeClient<tonic::transport::Channel>,
    mut p: pb::prefill_client::PrefillClient<tonic::transport::Channel>,
    key: pb::RoomKey,
    prefill: String,
    prompt: Vec<u32>,
    sampling: pb::SamplingParams,
    n: u64,
) -> (Result<Vec<u32>, tonic::Status>, Result<(), tonic::Status>) {
    let dreq = pb::DecodeRequest {
        request_id: format!("reuse-{n}"),
        room: Some(key.clone()),
        prefill_bootstrap_addr: prefill,
        token_ids: prompt.clone(),
        sampling: Some(sampling.clone()),
    };
    let preq = pb::PrefillRequest {
        request_id: format!("reuse-{n}"),
        room: Some(key),
        token_ids: prompt,
        sampling: Some(sampling),
        priority: 0,
        pull_from: String::new(),
    };
    let decode_call = async move {
        let mut s = d.generate(dreq).await?.into_inner();
        let mut tokens = Vec::new();
        while let Some(m) = s.message().await? {
            tokens.extend(m.token_ids);
        }
        Ok(tokens)
    };
    tokio::join!(decode_call, async move { p.prefill(preq).await.map(|_| ()) })
}

/// Sends `rounds` × 2 pairs with one room key to the decode worker at `decode` and the
/// prefill worker at `prefill` (the decode worker's bootstrap address); every other pair is
/// dropped mid-flight and the next sent at once.
pub async fn run(decode: &str, prefill: &str, prompt: &[u32], want: &[u32], rounds: u64) -> Reuse {
    let key = ferry_cluster::wire::room_key_to_proto(&RoomKey::random());
    let sampling = ferry_cluster::wire::sampling_to_proto(&ferry_tests::greedy(want.len() as u32));
    let d = pb::decode_client::DecodeClient::new(ferry_tests::channel(decode.parse().expect("addr")).await);
    let p = pb::prefill_client::PrefillClient::new(ferry_tests::channel(prefill.parse().expect("addr")).await);
    let mut out = Reuse::default();
    while out.sent < 2 * rounds {
        out.sent += 1;
        let n = out.sent;
        let call = pair(d.clone(), p.clone(), key.clone(), prefill.to_string(), prompt.to_vec(), sampling.clone(), n);
        let (dres, pres) = if n % 2 == 0 {
            // Dropped after 20–220 ms: while the room is queued, computing, on the wire or
            // decoding, on either side.
            match tokio::time::timeout(Duration::from_millis(20 + n * 37 % 200), call).await {
                Err(_) => {
                    out.cancelled += 1;
                    continue;
                }
                Ok(r) => r,
            }
        } else {
            match tokio::time::timeout(CALL_TIMEOUT, call).await {
                Err(_) => {
                    out.hung += 1;
                    continue;
                }
                Ok(r) => r,
            }
        };
        match dres {
            Ok(t) if t == want => out.completed += 1,
            Ok(_) => out.wrong += 1,
            Err(s) => out.error("decode", &s),
        }
        if let Err(s) = pres {
            out.error("prefill", &s);
        }
    }
    out
}
