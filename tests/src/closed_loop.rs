//! A closed loop of clients straight to one decode worker over gRPC, as the decode benches
//! drive it: each client sends its next request as soon as the last ended, until a deadline,
//! and keeps every token's arrival time.

use std::time::Instant;

use ferry_cluster::RoomKey;
use ferry_engine::SamplingParams;
use ferry_proto::v1 as pb;

use crate::channel;

/// One request's outcome: tokens received before the deadline, whether it ended (and how),
/// token arrival times.
#[derive(Default)]
pub struct Outcome {
    /// Tokens received.
    pub tokens: usize,
    /// The stream ended before the deadline.
    pub ended: bool,
    /// It ended with a stop (not a length or an error).
    pub stopped: bool,
    /// When each token came.
    pub arrivals: Vec<Instant>,
}

/// One Decode.Generate of `prompt`, read until it ends or `deadline` (then dropped, which
/// cancels it).
pub async fn one(
    d: &mut pb::decode_client::DecodeClient<tonic::transport::Channel>,
    prompt: Vec<u32>,
    params: &SamplingParams,
    deadline: Instant,
) -> Outcome {
    let key = RoomKey::random();
    let req = pb::DecodeRequest {
        request_id: format!("bench-{}", key.room.get()),
        room: Some(ferry_cluster::wire::room_key_to_proto(&key)),
        prefill_bootstrap_addr: String::new(),
        token_ids: prompt,
        sampling: Some(ferry_cluster::wire::sampling_to_proto(params)),
    };
    let mut out = Outcome::default();
    let Ok(s) = d.generate(req).await else { return out };
    let mut s = s.into_inner();
    loop {
        match tokio::time::timeout_at(deadline.into(), s.message()).await {
            Ok(Ok(Some(m))) => {
                let now = Instant::now();
                out.tokens += m.token_ids.len();
                out.arrivals.extend(std::iter::repeat_n(now, m.token_ids.len()));
                out.stopped |= m.finish_reason == pb::FinishReason::Stop as i32;
            }
            Ok(_) => {
                out.ended = true;
                return out;
            }
            // The window closed: dropping the stream cancels the request.
            Err(_) => return out,
        }
    }
}

/// A client: requests back to back until `deadline`, prompts in turn from `first`.
pub async fn client(
    addr: std::net::SocketAddr,
    prompts: Vec<Vec<u32>>,
    first: usize,
    params: SamplingParams,
    deadline: Instant,
) -> Vec<Outcome> {
    let mut d = pb::decode_client::DecodeClient::new(channel(addr).await);
    let mut outs = Vec::new();
    let mut i = first;
    while Instant::now() < deadline {
        outs.push(one(&mut d, prompts[i % prompts.len()].clone(), &params, deadline).await);
        i += 1;
    }
    outs
}

/// The `p` quantile of `v` (sorted in place; 0 when empty).
pub fn percentile(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * p).round() as usize]
}
