//! The cache effect of placement: multi-turn conversations sharing system prompts, spread
//! over 4 prefill daemons through the router. Prefill tokens computed (prompt minus cached)
//! under cache-aware placement and under round-robin are printed with their ratio; cache-aware
//! computes fewer.

use std::time::Duration;

use ferry_proto::v1 as pb;
use ferry_tests::{TinyModel, channel, greedy};

struct Rng(u64);
impl Rng {
    fn tokens(&mut self, n: usize) -> Vec<u32> {
        (0..n)
            .map(|_| {
                self.0 ^= self.0 << 13;
                self.0 ^= self.0 >> 7;
                self.0 ^= self.0 << 17;
                (self.0 % 350) as u32
            })
            .collect()
    }
}

/// Runs the workload under `policy`; returns (prompt tokens, cached tokens).
async fn run(m: &TinyModel, policy: ferry_router::placement::Policy) -> (u64, u64) {
    let mut ps = Vec::new();
    for _ in 0..4 {
        let mut a = ferry_prefill::PrefillArgs::for_model(m.path());
        a.worker.pool_pages = 1024;
        ps.push(ferry_prefill::start(a).await.expect("prefill up"));
    }
    let mut a = ferry_decode::DecodeArgs::for_model(m.path());
    a.worker.pool_pages = 2048;
    let d = ferry_decode::start(a).await.expect("decode up");
    let mut args = ferry_router::RouterArgs::new(
        m.path(),
        ps.iter().map(|p| p.grpc_addr.to_string()).collect(),
        vec![d.grpc_addr.to_string()],
    );
    args.policy = policy;
    // Every turn on a prefill worker: the decode worker holds each conversation's history
    // (answers included) and would otherwise prefill later turns itself, under either policy.
    args.local_prefill_max = 0;
    // Placement alone: with pulls, the prefill worker round-robin picks pulls each
    // conversation's history from the decode worker, which holds them all (both policies then
    // compute the same 3,274 tokens).
    args.disable_pull = true;
    let r = ferry_router::start(args).await.expect("router up");
    for _ in 0..200 {
        if r.workers().snapshot().all().all(|w| w.healthy()) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let client = pb::router_client::RouterClient::new(channel(r.grpc_addr).await);
    let mut rng = Rng(77);
    let systems: Vec<Vec<u32>> = (0..4).map(|_| rng.tokens(256)).collect();
    // 15, not a multiple of the 4 workers: round-robin does not keep a conversation in place.
    let mut convs: Vec<Vec<u32>> = (0..15).map(|i| systems[i % 4].clone()).collect();
    let (mut prompt, mut cached) = (0u64, 0u64);
    for _turn in 0..3 {
        for c in &mut convs {
            c.extend(rng.tokens(48));
            let req = pb::GenerateRequest {
                prompt: Some(pb::generate_request::Prompt::TokenIds(pb::TokenIds { ids: c.clone() })),
                sampling: Some(ferry_cluster::wire::sampling_to_proto(&greedy(2))),
                return_token_ids: true,
                ..Default::default()
            };
            let mut s = client.clone().generate(req).await.expect("accepted").into_inner();
            let mut reply = Vec::new();
            while let Some(m) = s.message().await.expect("stream") {
                reply.extend(m.token_ids);
                if m.finish_reason != 0 {
                    prompt += u64::from(m.prompt_tokens);
                    cached += u64::from(m.cached_tokens);
                }
            }
            c.extend(reply);
            // Let the worker's KV events reach the router before the next placement.
            tokio::time::sleep(Duration::from_millis(30)).await;
        }
    }
    r.stop().await;
    for p in ps {
        p.stop().await;
    }
    d.stop().await;
    (prompt, cached)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cache_aware_placement_computes_fewer_prefill_tokens_than_round_robin() {
    let m = TinyModel::new();
    let (p_ca, c_ca) = run(&m, ferry_router::placement::Policy::CacheAware).await;
    let (p_rr, c_rr) = run(&m, ferry_router::placement::Policy::RoundRobin).await;
    assert_eq!(p_ca, p_rr, "the same workload");
    let (ca, rr) = (p_ca - c_ca, p_rr - c_rr);
    println!(
        "prefill tokens computed over 45 requests (15 conversations x 3 turns, 4 shared system prompts, 4 prefill workers): cache-aware {ca}, round-robin {rr}, ratio {:.3}",
        ca as f64 / rr as f64
    );
    assert!(ca < rr, "cache-aware {ca} vs round-robin {rr}");
}
