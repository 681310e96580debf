//! Migration (issue 61): a decode node is SIGKILLed while it streams answers; the router
//! moves each of its streams to the other decode node, and every answer finishes — greedy
//! and seeded alike — exactly as an undisturbed run's, with no error and no token twice.
//! Real processes (`ferry prefill`, `ferry decode` ×2, `ferry router`) on SmolLM2.

#[allow(dead_code)] // the chaos suite uses the rest of it
#[path = "support/daemon.rs"]
mod daemon;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use daemon::Daemon;
use ferry_engine::SamplingParams;
use ferry_proto::v1 as pb;

/// A free loopback address.
fn port() -> String {
    format!("127.0.0.1:{}", ferry_tests::etcd::free_port())
}

fn strings(a: &[&str]) -> Vec<String> {
    a.iter().map(|s| s.to_string()).collect()
}

/// The tokens streamed so far for each request, and whether each ended with a finish reason.
type Streams = Arc<Mutex<Vec<(Vec<u32>, Option<i32>)>>>;

/// Sends `prompt` through the router at `addr`, recording each message's tokens in
/// `streams[i]` as they come; panics on any error (a migration hides the kill).
async fn stream(addr: String, prompt: Vec<u32>, params: SamplingParams, streams: Streams, i: usize) {
    let channel = ferry_tests::channel(addr.parse().expect("addr")).await;
    let mut c = pb::router_client::RouterClient::new(channel);
    let req = pb::GenerateRequest {
        request_id: format!("migrate-{i}"),
        prompt: Some(pb::generate_request::Prompt::TokenIds(pb::TokenIds { ids: prompt })),
        sampling: Some(ferry_cluster::wire::sampling_to_proto(&params)),
        stop: Vec::new(),
        return_token_ids: true,
        return_phases: false,
    };
    let mut s = c.generate(req).await.expect("generate").into_inner();
    while let Some(m) = s.message().await.unwrap_or_else(|e| panic!("stream {i} failed: {e}")) {
        let mut all = streams.lock().expect("streams");
        all[i].0.extend(&m.token_ids);
        if m.finish_reason != 0 {
            all[i].1 = Some(m.finish_reason);
        }
    }
}

/// Streams under way: their recorded tokens and their tasks.
struct Running(Streams, Vec<tokio::task::JoinHandle<()>>);

/// Starts `prompts` at once, each with its parameters.
fn start(addr: &str, prompts: &[(Vec<u32>, SamplingParams)]) -> Running {
    let streams: Streams = Arc::new(Mutex::new(vec![(Vec::new(), None); prompts.len()]));
    let tasks = prompts
        .iter()
        .enumerate()
        .map(|(i, (p, s))| tokio::spawn(stream(addr.to_string(), p.clone(), s.clone(), Arc::clone(&streams), i)))
        .collect();
    Running(streams, tasks)
}

impl Running {
    /// Waits until every stream has sent at least `n` tokens.
    async fn sent(&self, n: usize) {
        let t = Instant::now();
        while self.0.lock().expect("streams").iter().any(|(t, _)| t.len() < n) {
            assert!(t.elapsed() < Duration::from_secs(120), "the streams sent fewer than {n} tokens in 120 s");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// Each stream's tokens and finish reason once all have ended.
    async fn ended(self) -> Vec<(Vec<u32>, Option<i32>)> {
        for t in self.1 {
            t.await.expect("stream task");
        }
        self.0.lock().expect("streams").clone()
    }
}

/// Several greedy streams and a seeded one, their decode node killed after ≥ 40 tokens each:
/// every stream ends with a finish reason and the tokens of an undisturbed run. With
/// `--migration-limit 0` (the behaviour before) the streams of the killed node fail.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_of_a_killed_decode_node_finish_on_the_other_as_if_undisturbed() {
    let model = ferry_tests::smollm2().display().to_string();
    let worker = |role: &str, id: &str, grpc: &str, metrics: &str| {
        let mut a = strings(&[role, "--model", &model, "--worker-id", id, "--grpc-addr", grpc, "--insecure-internal"]);
        a.extend(strings(&["--metrics-addr", metrics, "--pool-pages", "512", "--page-size", "16"]));
        Daemon::new(id, a, grpc.to_string())
    };
    let (pg, d0, d1) = (port(), port(), port());
    let mut prefill = worker("prefill", "p0", &pg, "127.0.0.1:0");
    let mut decode = [worker("decode", "d0", &d0, "127.0.0.1:0"), worker("decode", "d1", &d1, "127.0.0.1:0")];
    let (rg, rm) = (port(), port());
    let mut ra = strings(&["router", "--model", &model, "--grpc-addr", &rg, "--metrics-addr", &rm]);
    ra.extend(strings(&["--insecure-internal", "--prefill", &format!("p0={pg}")]));
    ra.extend(strings(&["--decode", &format!("d0={d0}"), "--decode", &format!("d1={d1}")]));
    // Every prompt through the prefill node; the migrated context too once it is long.
    ra.extend(strings(&["--local-prefill-max", "0"]));
    let mut router = Daemon::new("router", ra, rg.clone());
    ferry_tests::blocking(|| {
        std::thread::scope(|s| {
            for d in std::iter::once(&mut prefill).chain(decode.iter_mut()) {
                s.spawn(|| d.start());
            }
        })
    });
    router.start();

    let prompt = |i: u32| -> Vec<u32> { (0..24).map(|k| 30 + (i * 131 + k * 17) % 9000).collect() };
    let greedy = SamplingParams { max_new_tokens: 96, ignore_eos: true, ..SamplingParams::default() };
    let seeded = SamplingParams { temperature: 0.8, top_p: 0.95, seed: Some(42), ..greedy.clone() };
    let mut prompts: Vec<(Vec<u32>, SamplingParams)> = (0..4).map(|i| (prompt(i), greedy.clone())).collect();
    prompts.push((prompt(9), seeded.clone()));
    prompts.push((prompt(10), seeded));
    let reference = start(&rg, &prompts).ended().await;
    for (i, (tokens, finish)) in reference.iter().enumerate() {
        assert_eq!((tokens.len(), finish.is_some()), (96, true), "reference {i}");
    }

    let metrics: std::net::SocketAddr = rm.parse().expect("addr");
    let placed = |body: &str, id: &str| {
        ferry_tests::metric_sum(body, "ferry_router_decode_placements_total", &format!("worker=\"{id}\""))
    };
    let before = ferry_tests::scrape(metrics).await;
    let running = start(&rg, &prompts);
    running.sent(40).await;
    // The node serving more of them (both serve some: placement spreads them).
    let now = ferry_tests::scrape(metrics).await;
    let served = |id: &str| placed(&now, id) - placed(&before, id);
    let i = usize::from(served("d1") > served("d0"));
    let served = served(["d0", "d1"][i]);
    decode[i].kill9();
    let out = running.ended().await;
    assert!(served >= 1.0, "the killed node d{i} served none of the streams");
    for (n, ((tokens, finish), (want, _))) in out.iter().zip(&reference).enumerate() {
        assert!(finish.is_some(), "stream {n} ended without a finish reason");
        assert_eq!(tokens, want, "stream {n} differs from its undisturbed run");
    }
    let after = ferry_tests::scrape(metrics).await;
    let resumed = ferry_tests::metric_sum(&after, "ferry_router_migrations_total", "outcome=\"resumed\"");
    assert_eq!(resumed, served, "every stream of the killed node moved once");
}
