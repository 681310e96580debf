//! Migration (issue 61): a decode node is SIGKILLed while it streams answers; the router
//! moves each of its streams to the other decode node, and every answer finishes — greedy
//! and seeded alike — exactly as an undisturbed run's, with no error and no token twice.
//! Real processes (`ferry prefill`, `ferry decode` ×2, `ferry router`) on SmolLM2.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ferry_engine::SamplingParams;
use ferry_proto::v1 as pb;
use ferry_tests::daemon::Daemon;

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

/// One prefill node, two decode nodes (each given `decode_flags`) and a router, as processes.
struct Cluster {
    _prefill: Daemon,
    decode: [Daemon; 2],
    _router: Daemon,
    /// The router's gRPC and `/metrics` addresses.
    grpc: String,
    metrics: std::net::SocketAddr,
}

impl Cluster {
    fn start(decode_flags: &[&str]) -> Self {
        let model = ferry_tests::smollm2().display().to_string();
        let worker = |role: &str, id: &str, grpc: &str, extra: &[&str]| {
            let mut a = strings(&[role, "--model", &model, "--worker-id", id, "--grpc-addr", grpc]);
            a.extend(strings(&["--insecure-internal", "--pool-pages", "512", "--page-size", "16"]));
            a.extend(strings(extra));
            Daemon::new(env!("CARGO_BIN_EXE_ferry"), id, a, grpc.to_string())
        };
        let (pg, d0, d1) = (port(), port(), port());
        let mut prefill = worker("prefill", "p0", &pg, &[]);
        let mut decode = [worker("decode", "d0", &d0, decode_flags), worker("decode", "d1", &d1, decode_flags)];
        let (rg, rm) = (port(), port());
        let mut ra = strings(&["router", "--model", &model, "--grpc-addr", &rg, "--metrics-addr", &rm]);
        ra.extend(strings(&["--insecure-internal", "--prefill", &format!("p0={pg}")]));
        ra.extend(strings(&["--decode", &format!("d0={d0}"), "--decode", &format!("d1={d1}")]));
        // Every prompt through the prefill node; a moved stream's context too.
        ra.extend(strings(&["--local-prefill-max", "0"]));
        let mut router = Daemon::new(env!("CARGO_BIN_EXE_ferry"), "router", ra, rg.clone());
        ferry_tests::blocking(|| {
            std::thread::scope(|s| {
                for d in std::iter::once(&mut prefill).chain(decode.iter_mut()) {
                    s.spawn(|| d.start());
                }
            })
        });
        router.start();
        Self { _prefill: prefill, decode, _router: router, grpc: rg, metrics: rm.parse().expect("addr") }
    }

    /// The router's count of `metric` samples whose labels contain `label`.
    async fn count(&self, metric: &str, label: &str) -> f64 {
        ferry_tests::metric_sum(&ferry_tests::scrape(self.metrics).await, metric, label)
    }

    /// Streams placed on decode node `d0` and `d1` so far.
    async fn placed(&self) -> [f64; 2] {
        let m = "ferry_router_decode_placements_total";
        [self.count(m, "worker=\"d0\"").await, self.count(m, "worker=\"d1\"").await]
    }
}

/// Four greedy streams and two seeded ones (temperature 0.8, top-p 0.95, seed 42), 96
/// tokens each.
fn requests() -> Vec<(Vec<u32>, SamplingParams)> {
    let prompt = |i: u32| -> Vec<u32> { (0..24).map(|k| 30 + (i * 131 + k * 17) % 9000).collect() };
    let greedy = SamplingParams { max_new_tokens: 96, ignore_eos: true, ..SamplingParams::default() };
    let seeded = SamplingParams { temperature: 0.8, top_p: 0.95, seed: Some(42), ..greedy.clone() };
    let mut r: Vec<(Vec<u32>, SamplingParams)> = (0..4).map(|i| (prompt(i), greedy.clone())).collect();
    r.push((prompt(9), seeded.clone()));
    r.push((prompt(10), seeded));
    r
}

/// Runs [`requests`] undisturbed (the reference), then again, calling `disturb` with the
/// decode node serving more of them once every stream has sent 40 tokens; asserts that every
/// stream ended with a finish reason and the reference's tokens, and returns that node, how
/// many streams it served and how many the router moved.
async fn disturbed(c: &mut Cluster, disturb: impl FnOnce(&mut Daemon)) -> (usize, f64, f64) {
    let prompts = requests();
    let reference = start(&c.grpc, &prompts).ended().await;
    for (i, (tokens, finish)) in reference.iter().enumerate() {
        assert_eq!((tokens.len(), finish.is_some()), (96, true), "reference {i}");
    }
    let resumed = "outcome=\"resumed\"";
    let (before, moved_before) = (c.placed().await, c.count("ferry_router_migrations_total", resumed).await);
    let running = start(&c.grpc, &prompts);
    running.sent(40).await;
    // Both serve some (placement spreads them): the node serving more.
    let now = c.placed().await;
    let served = [now[0] - before[0], now[1] - before[1]];
    let i = usize::from(served[1] > served[0]);
    assert!(served[i] >= 1.0, "d{i} served none of the streams: {served:?}");
    disturb(&mut c.decode[i]);
    let out = running.ended().await;
    for (n, ((tokens, finish), (want, _))) in out.iter().zip(&reference).enumerate() {
        assert!(finish.is_some(), "stream {n} ended without a finish reason");
        assert_eq!(tokens, want, "stream {n} differs from its undisturbed run");
    }
    (i, served[i], c.count("ferry_router_migrations_total", resumed).await - moved_before)
}

/// The tests here run 4 processes on SmolLM2 each: one at a time.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Streams whose decode node is SIGKILLed after 40 tokens each finish on the other node as
/// an undisturbed run would have them, each moved once. With `--migration-limit 0` (the
/// behaviour before) the killed node's streams fail (`decode worker d0 failed after 40
/// tokens`); with the moved request not marked resumed the seeded streams differ.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_of_a_killed_decode_node_finish_on_the_other_as_if_undisturbed() {
    let _one = ONE_AT_A_TIME.lock().await;
    let mut c = Cluster::start(&[]);
    let (_, served, moved) = disturbed(&mut c, Daemon::kill9).await;
    assert_eq!(moved, served, "every stream of the killed node moved once");
}

/// A decode node stopped (SIGTERM) with `--drain-grace 0.1` while its streams have ~56 tokens
/// to go (0.3 s at the least on an idle machine: a grace of 1 s let a quiet run finish them
/// all there): it leaves placement, the grace passes, it ends what still runs,
/// and the router moves each stream to the other node, which finishes it as an undisturbed
/// run would; the stopped process exits by itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_draining_decode_node_hands_its_streams_over_when_its_grace_ends() {
    let _one = ONE_AT_A_TIME.lock().await;
    let mut c = Cluster::start(&["--drain-grace", "0.1"]);
    let (i, served, moved) = disturbed(&mut c, |d| d.signal(libc::SIGTERM)).await;
    assert_eq!(moved, served, "every stream of the drained node moved once");
    let d = &mut c.decode[i];
    assert!(ferry_tests::blocking(|| d.exits_within(Duration::from_secs(30))), "d{i} did not exit");
}

/// The same with a grace longer than the answers: the draining node finishes its streams
/// itself, the router moves none, and the process exits once they are done.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_draining_decode_node_finishes_what_ends_within_its_grace() {
    let _one = ONE_AT_A_TIME.lock().await;
    let mut c = Cluster::start(&["--drain-grace", "120"]);
    let (i, _, moved) = disturbed(&mut c, |d| d.signal(libc::SIGTERM)).await;
    assert_eq!(moved, 0.0, "no stream moved");
    let d = &mut c.decode[i];
    assert!(ferry_tests::blocking(|| d.exits_within(Duration::from_secs(30))), "d{i} did not exit");
}
