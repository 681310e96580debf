//! The cache effect of placement: multi-turn conversations sharing system prompts, spread
//! over 4 prefill daemons through the router. Prefill tokens computed, as the prefill nodes
//! count them (`ferry_prefill_tokens_total`), under cache-aware placement and under
//! round-robin are printed with their ratio, which must be near the documented 0.438
//! (docs/performance.md): every placement waits until the router's index holds what the
//! previous requests cached, so the figure does not depend on the machine's speed.

use std::time::Duration;

use ferry_proto::v1 as pb;
use ferry_tests::{TinyModel, channel, greedy, metric_sum, scrape, until};

/// Prompt tokens the prefill nodes computed, and the decode node: the process's counters
/// (all in-process daemons share one registry), read from a daemon's `/metrics`.
async fn computed(metrics: std::net::SocketAddr) -> (f64, f64) {
    let body = scrape(metrics).await;
    let count = |role: &str| metric_sum(&body, "ferry_prefill_tokens_total", &format!("role=\"{role}\""));
    (count("prefill"), count("decode"))
}

/// What one run measured.
struct Run {
    /// Prompt tokens of every request.
    prompt: u64,
    /// Prompt tokens the workers reported found cached.
    cached: u64,
    /// Prompt tokens the prefill nodes computed.
    computed: f64,
    /// Prompt tokens the decode node computed.
    computed_on_decode: f64,
}

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

/// Runs the workload under `policy`.
async fn run(m: &TinyModel, policy: ferry_router::placement::Policy) -> Run {
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
    let before = computed(ps[0].metrics_addr).await;
    let page = r.prefill_index().page_size();
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
            // The next placement sees what this request cached: the prompt's whole pages,
            // on some prefill node, as that node's KV events told the router.
            let whole = c.len() / page * page;
            until("the router's index to hold the prompt's cached pages", || {
                r.prefill_index().confirmed_matched(c, ps.len()).contains(&whole)
            })
            .await;
            c.extend(reply);
        }
    }
    let after = computed(ps[0].metrics_addr).await;
    r.stop().await;
    for p in ps {
        p.stop().await;
    }
    d.stop().await;
    Run { prompt, cached, computed: after.0 - before.0, computed_on_decode: after.1 - before.1 }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cache_aware_placement_computes_fewer_prefill_tokens_than_round_robin() {
    let m = TinyModel::new();
    let ca = run(&m, ferry_router::placement::Policy::CacheAware).await;
    let rr = run(&m, ferry_router::placement::Policy::RoundRobin).await;
    assert_eq!(ca.prompt, rr.prompt, "the same workload");
    for (name, run) in [("cache-aware", &ca), ("round-robin", &rr)] {
        assert_eq!(run.computed_on_decode, 0.0, "{name}: the decode node prefilled (local_prefill_max is 0)");
        // The workers' own reports of what they found cached agree with what they computed.
        assert_eq!(run.computed, (run.prompt - run.cached) as f64, "{name}: computed vs prompt - cached");
    }
    let ratio = ca.computed / rr.computed;
    println!(
        "prefill tokens computed over 45 requests (15 conversations x 3 turns, 4 shared system prompts, 4 prefill workers): cache-aware {}, round-robin {}, ratio {ratio:.3}",
        ca.computed, rr.computed
    );
    // docs/performance.md: 3,274 against 7,482, 0.438.
    assert!(
        (0.41..=0.47).contains(&ratio),
        "cache-aware {} vs round-robin {}: ratio {ratio:.3}, documented 0.438",
        ca.computed,
        rr.computed
    );
}
