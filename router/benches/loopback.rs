//! W3 of issue 17, end to end over loopback: the real `ferry-router` process pinned to one
//! core, and on the other core zero-cost mock workers (4 prefill, 2 decode; real gRPC,
//! `common/mock_workers.rs`) and the load: `c` keep-alive HTTP connections each sending the
//! next request as soon as the last one is answered (non-streaming, 8 output tokens).
//!
//! Bodies: a 16 KB chat (an 8 KB system prompt shared by every request, an 8 KB user message
//! of its own), with the tokenizer's head cache on and off; and `/v1/completions` with a
//! ~4,500-token prompt, its first half shared; and a short chat (a 64-byte user message: the
//! router's fixed cost per request). Each request writes its own number (one count for the whole run) at the start
//! of its own part, so no two prompts are alike; the router tokenizes every one.
//!
//! Per cell it prints req/s, the router's CPU (from `/proc`), router CPU-µs per answered
//! request and req/s per router core (answered requests / router CPU-seconds), p50 / p99
//! latency, the same through
//! the direct baseline — the load calling the mock workers' `Prefill` and `Generate` itself
//! with the prompt's ids, as the router would — and the difference (added p50 / p99), and the
//! router's RSS, and the share refused as busy (429: the tokenizer pool's queue is full —
//! 1,024 requests or 16 MiB of bodies per core; a refused client waits 5 ms). Last, the direct baseline again from a
//! thread on the router's core (`dir0`: every call then crosses cores, as the router's do)
//! and the router's p50 beyond it (`+p50/0`: the router's own work, without the cost of
//! waking the other core that the one-core baseline never pays). Then the same load through a
//! proxy on the router's core that does none of the router's work (`common/null_proxy.rs`:
//! the body read, the same two calls with messages encoded before the run, a fixed answer):
//! `null +p50` is what the hops alone add over the direct baseline on this host, a floor under
//! any router's added p50, and `work p50` the router's p50 beyond it (parsing, tokenizing,
//! placement, encoding, the answer's text). Both mean something at c = 1 only: at c >= 8 the
//! null proxy, on a core of its own with nothing to encode, beats the direct baseline, whose
//! load shares a saturated core with the workers. Under each row, the means of the router's
//! own phases over the cell (from its `/metrics`: admission, parsing and tokenizing,
//! placement, placement to the first token, the rest). After each run, `GET /health`
//! at c = 1: the HTTP hop to the router's core alone. smg's figures (issue 17, this machine) are
//! printed beside.
//!
//! `cargo bench -p ferry-router --bench loopback`; `FERRY_BENCH_PREFILL=N` for N prefill
//! workers instead of 4 (the router scores every one per request); needs SmolLM2 (`FERRY_SMOLLM2` or the
//! `ferry model fetch smollm2-135m` cache) and `taskset`; `FERRY_BENCH_QUICK=1` runs 0.5 s
//! cells at c = 1 and 8 (CI smoke run). For profiling one cell: `FERRY_BENCH_ONLY` names the
//! runs to keep (any of `chat`, `chat-nocache`, `completions`, `short`, comma-separated),
//! `FERRY_BENCH_C` the concurrency levels (e.g. `1`), `FERRY_BENCH_SECS` a cell's seconds
//! on each path, `FERRY_BENCH_SLICES=1` each path's cell in one piece (by default the paths
//! take turns in slices of at most 0.5 s, so that the host's drift falls on all alike; one
//! piece, to profile the router over one long run);
//! `FERRY_BENCH_ROUTER_CORE=1` puts the router on the load's core (no request then crosses
//! cores: what waking an idle core costs).

#[path = "common/mock_workers.rs"]
mod mock_workers;
#[path = "common/null_proxy.rs"]
mod null_proxy;
#[path = "common/rng.rs"]
#[allow(dead_code)]
mod rng;
#[path = "common/text.rs"]
mod text;

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use ferry_proto::v1 as pb;
use ferry_tokenize::ServedModel;
use http_body_util::BodyExt;
use hyper_util::rt::TokioIo;
use rng::Rng;
use text::{WORDS, model_path, pct};

/// Plain English words only.
const PLAIN: &[&str] = WORDS.split_at(51).0;

const OUTPUT_TOKENS: u32 = 8;
/// Mock prefill workers unless `FERRY_BENCH_PREFILL` says how many.
const PREFILL_WORKERS: usize = 4;
const DECODE_WORKERS: usize = 2;

fn text(rng: &mut Rng, bytes: usize) -> String {
    let mut s = String::with_capacity(bytes + 16);
    while s.len() < bytes {
        s.push_str(PLAIN[(rng.next() % PLAIN.len() as u64) as usize]);
        s.push(if rng.next().is_multiple_of(12) { '\n' } else { ' ' });
    }
    s
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr").port()
}

/// Where a body takes its request's number, so that no two requests send the same prompt.
const MARK: &str = "@@N@@";

/// One kind of request: bodies (each split where the request's number goes, at the start of
/// its own part of the prompt) and their prompts' ids for the direct path.
#[derive(Clone)]
struct Workload {
    name: &'static str,
    path: &'static str,
    bodies: Arc<Vec<(String, String)>>,
    ids: Arc<Vec<Vec<u32>>>,
}

impl Workload {
    fn new(name: &'static str, path: &'static str, bodies: Vec<(String, String)>, ids: Vec<Vec<u32>>) -> Self {
        Self { name, path, bodies: Arc::new(bodies), ids: Arc::new(ids) }
    }
}

fn split(body: String) -> (String, String) {
    let at = body.find(MARK).expect("mark");
    (body[..at].to_string(), body[at + MARK.len()..].to_string())
}

fn workloads(model: &ServedModel) -> Vec<Workload> {
    let mut rng = Rng(0x3eed);
    let name = &model.name;
    let tok = &model.tokenizer;
    let variants = 256;
    // Chat: 8 KB system prompt shared, 8 KB user message each.
    let system = text(&mut rng, 8 * 1024);
    let template = tok.chat_template().expect("chat template");
    let (mut chat, mut chat_ids) = (Vec::new(), Vec::new());
    for _ in 0..variants {
        let user = format!("{MARK} {}", text(&mut rng, 8 * 1024));
        let msgs = [
            ferry_tokenize::ChatMessage::new("system", system.clone()),
            ferry_tokenize::ChatMessage::new("user", user.clone()),
        ];
        chat_ids.push(tok.encode(&template.render(&msgs, true).expect("render")).expect("encode"));
        let body = serde_json::json!({
            "model": name, "max_tokens": OUTPUT_TOKENS,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
        });
        chat.push(split(body.to_string()));
    }
    // Completions: ~4,500 tokens, the first half shared.
    let mut shared = String::new();
    while tok.encode(&shared).expect("encode").len() < 2_250 {
        shared.push_str(&text(&mut rng, 512));
    }
    let (mut comp, mut comp_ids) = (Vec::new(), Vec::new());
    for i in 0..variants {
        let mut own = format!("{MARK}{i} ");
        while tok.encode(&own).expect("encode").len() < 2_250 {
            own.push_str(&text(&mut rng, 512));
        }
        let prompt = format!("{shared}{own}");
        comp_ids.push(tok.encode(&prompt).expect("encode"));
        comp.push(split(serde_json::json!({"model": name, "max_tokens": OUTPUT_TOKENS, "prompt": prompt}).to_string()));
    }
    // A short chat: the router's fixed cost per request.
    let (mut short, mut short_ids) = (Vec::new(), Vec::new());
    for _ in 0..variants {
        let user = format!("{MARK} {}", text(&mut rng, 64));
        let msgs = [ferry_tokenize::ChatMessage::new("user", user.clone())];
        short_ids.push(tok.encode(&template.render(&msgs, true).expect("render")).expect("encode"));
        let body = serde_json::json!({
            "model": name, "max_tokens": OUTPUT_TOKENS, "messages": [{"role": "user", "content": user}],
        });
        short.push(split(body.to_string()));
    }
    let chat_bytes = chat.iter().map(|(a, b)| a.len() + b.len()).sum::<usize>() / variants;
    let comp_tokens = comp_ids.iter().map(Vec::len).sum::<usize>() / variants;
    println!(
        "bodies: chat {chat_bytes} bytes ({} tokens); completions {comp_tokens} tokens, half shared",
        chat_ids[0].len()
    );
    vec![
        Workload::new("chat 16 KB", "/v1/chat/completions", chat, chat_ids),
        Workload::new("completions 4.5 k tokens", "/v1/completions", comp, comp_ids),
        Workload::new("short chat (~64 bytes)", "/v1/chat/completions", short, short_ids),
    ]
}

/// The router's user + system CPU seconds and RSS (MB) from `/proc`.
fn router_cpu(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("router stat");
    let after = &stat[stat.rfind(')').expect("comm") + 2..];
    let f: Vec<&str> = after.split_whitespace().collect();
    let ticks: f64 = f[11].parse::<f64>().expect("utime") + f[12].parse::<f64>().expect("stime");
    ticks / clock_ticks()
}

fn clock_ticks() -> f64 {
    static HZ: std::sync::OnceLock<f64> = std::sync::OnceLock::new();
    *HZ.get_or_init(|| {
        let out = Command::new("getconf").arg("CLK_TCK").output().expect("getconf");
        String::from_utf8_lossy(&out.stdout).trim().parse().unwrap_or(100.0)
    })
}

/// The router's phases ([`ferry_cluster::phases`]), in the order it records them.
const PHASES: [&str; 5] = ["queue", "tokenize", "placement", "first_token", "decode"];

/// Each of [`PHASES`]' seconds summed and requests counted, from the router's `/metrics`.
async fn router_phases(addr: &str) -> [(f64, f64); 5] {
    let (_, m) = get(addr, "/metrics").await.expect("router metrics");
    let read = |phase: &str, what: &str| {
        let key = format!("ferry_request_phase_seconds_{what}{{role=\"router\",phase=\"{phase}\"}} ");
        m.lines().find_map(|l| l.strip_prefix(key.as_str())).and_then(|v| v.trim().parse().ok()).unwrap_or(0.0)
    };
    PHASES.map(|p| (read(p, "sum"), read(p, "count")))
}

fn rss_mb(pid: u32, key: &str) -> f64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("router status");
    let line = status.lines().find(|l| l.starts_with(key)).expect("rss line");
    line.split_whitespace().nth(1).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0) / 1024.0
}

struct Router {
    child: Child,
    http: String,
}

impl Drop for Router {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn prefill_workers() -> usize {
    std::env::var("FERRY_BENCH_PREFILL").ok().and_then(|v| v.parse().ok()).unwrap_or(PREFILL_WORKERS)
}

async fn start_router(model: &PathBuf, prefill: &[String], decode: &[String], cache_mib: usize) -> Router {
    let http = format!("127.0.0.1:{}", free_port());
    let mut c = Command::new("taskset");
    let core = std::env::var("FERRY_BENCH_ROUTER_CORE").unwrap_or_else(|_| "0".into());
    c.args(["-c", &core, env!("CARGO_BIN_EXE_ferry-router"), "--model"]).arg(model);
    for p in prefill {
        c.args(["--prefill", p]);
    }
    for d in decode {
        c.args(["--decode", d]);
    }
    c.args(["--http-addr", &http, "--insecure-internal", "--tokenizer-cache-mib", &cache_mib.to_string()]);
    c.env("RUST_LOG", "warn").stdout(Stdio::null()).stderr(Stdio::inherit());
    let child = c.spawn().expect("start ferry-router");
    let router = Router { child, http };
    // Ready: every worker healthy.
    let want = format!("ferry_router_workers{{role=\"prefill\",state=\"healthy\"}} {}", prefill.len());
    for _ in 0..600 {
        if let Ok((200, m)) = get(&router.http, "/metrics").await
            && m.contains(&want)
        {
            return router;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("the router at {} did not see its workers healthy in 30 s", router.http);
}

async fn connect(addr: &str) -> hyper::client::conn::http1::SendRequest<http_body_util::Full<hyper::body::Bytes>> {
    let tcp = tokio::net::TcpStream::connect(addr).await.expect("connect");
    tcp.set_nodelay(true).expect("nodelay");
    let (send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp)).await.expect("handshake");
    tokio::spawn(conn);
    send
}

async fn get(addr: &str, path: &str) -> Result<(u16, String), hyper::Error> {
    let Ok(tcp) = tokio::net::TcpStream::connect(addr).await else { return Ok((0, String::new())) };
    let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp)).await?;
    tokio::spawn(conn);
    let req = hyper::Request::get(path)
        .header("host", addr)
        .body(http_body_util::Full::<hyper::body::Bytes>::default())
        .expect("request");
    let resp = send.send_request(req).await?;
    let status = resp.status().as_u16();
    let body = resp.into_body().collect().await?.to_bytes();
    Ok((status, String::from_utf8_lossy(&body).into_owned()))
}

/// The number the next request writes into its prompt: one count for the whole run (warm-up,
/// every cell, slice and connection), so that no prompt is ever sent twice.
static NEXT_REQUEST: AtomicUsize = AtomicUsize::new(0);

/// Latencies (seconds) of every request answered in `secs`, `c` at a time; requests that
/// failed; requests refused as busy.
async fn through_router(addr: &str, w: &Workload, c: usize, secs: f64) -> (Vec<f64>, usize, usize) {
    let stop = Arc::new(AtomicBool::new(false));
    let bodies = &w.bodies;
    let mut tasks = Vec::new();
    for _ in 0..c {
        let (stop, bodies, addr, path) = (Arc::clone(&stop), Arc::clone(bodies), addr.to_string(), w.path);
        tasks.push(tokio::spawn(async move {
            let mut send = connect(&addr).await;
            let (mut lat, mut failed, mut refused) = (Vec::new(), 0usize, 0usize);
            while !stop.load(Ordering::Relaxed) {
                let i = NEXT_REQUEST.fetch_add(1, Ordering::Relaxed);
                let (pre, post) = &bodies[i % bodies.len()];
                let body = hyper::body::Bytes::from(format!("{pre}{i}{post}"));
                let req = hyper::Request::post(path)
                    .header("host", &addr)
                    .header("content-type", "application/json")
                    .body(http_body_util::Full::new(body))
                    .expect("request");
                let t = Instant::now();
                let status = match send.send_request(req).await {
                    Ok(resp) => {
                        let s = resp.status().as_u16();
                        if resp.into_body().collect().await.is_ok() { s } else { 0 }
                    }
                    Err(_) => 0,
                };
                match status {
                    200 => lat.push(t.elapsed().as_secs_f64()),
                    // Busy (the tokenizer pool's queue or admission): a client backs off.
                    429 | 503 => {
                        refused += 1;
                        tokio::time::sleep(Duration::from_millis(5)).await;
                    }
                    _ => {
                        failed += 1;
                        send = connect(&addr).await;
                    }
                }
            }
            (lat, failed, refused)
        }));
    }
    tokio::time::sleep(Duration::from_secs_f64(secs)).await;
    stop.store(true, Ordering::Relaxed);
    let (mut all, mut failed, mut refused) = (Vec::new(), 0, 0);
    for t in tasks {
        let (l, f, r) = t.await.expect("client");
        all.extend(l);
        failed += f;
        refused += r;
    }
    (all, failed, refused)
}

/// The direct baseline: the load calls `Prefill` and `Generate` itself with the prompt's ids.
async fn direct(prefill: &[String], decode: &[String], w: &Workload, c: usize, secs: f64) -> Vec<f64> {
    let stop = Arc::new(AtomicBool::new(false));
    let ids = &w.ids;
    let mut tasks = Vec::new();
    for k in 0..c {
        let p = format!("http://{}", prefill[k % prefill.len()]);
        let d = format!("http://{}", decode[k % decode.len()]);
        let (stop, ids) = (Arc::clone(&stop), Arc::clone(ids));
        tasks.push(tokio::spawn(async move {
            let mut pc = pb::prefill_client::PrefillClient::connect(p)
                .await
                .expect("prefill")
                .max_encoding_message_size(64 << 20);
            let mut dc =
                pb::decode_client::DecodeClient::connect(d).await.expect("decode").max_encoding_message_size(64 << 20);
            let (mut lat, mut i) = (Vec::new(), k * 7);
            while !stop.load(Ordering::Relaxed) {
                let t = Instant::now();
                let tokens = ids[i % ids.len()].clone();
                i += 1;
                let (preq, dreq) = mock_workers::requests(tokens, i as u64, OUTPUT_TOKENS);
                let (p, d) = tokio::join!(pc.prefill(preq), async {
                    let mut s = dc.generate(dreq).await?.into_inner();
                    while s.message().await?.is_some() {}
                    Ok::<_, tonic::Status>(())
                });
                p.expect("prefill");
                d.expect("generate");
                lat.push(t.elapsed().as_secs_f64());
            }
            lat
        }));
    }
    tokio::time::sleep(Duration::from_secs_f64(secs)).await;
    stop.store(true, Ordering::Relaxed);
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.expect("client"));
    }
    all
}

/// p50 (ms) of `GET /health` on one keep-alive connection for `secs`: what any HTTP hop to
/// the router's core costs, before it does any work for a request.
async fn health_p50(addr: &str, secs: f64) -> f64 {
    let mut send = connect(addr).await;
    let mut lat = Vec::new();
    let t0 = Instant::now();
    while t0.elapsed().as_secs_f64() < secs {
        let req = hyper::Request::get("/health")
            .header("host", addr)
            .body(http_body_util::Full::<hyper::body::Bytes>::default())
            .expect("request");
        let t = Instant::now();
        let resp = send.send_request(req).await.expect("health");
        resp.into_body().collect().await.expect("health body");
        lat.push(t.elapsed().as_secs_f64());
    }
    pct(&mut lat, 0.5) * 1e3
}

/// Moves the calling thread to core 0, the router's (the bench's threads start on core 1).
fn pin_this_thread_to_core0() {
    let me = std::fs::read_link("/proc/thread-self").expect("thread-self");
    let tid = me.file_name().expect("tid").to_string_lossy().into_owned();
    let pinned = Command::new("taskset").args(["-p", "-c", "0", &tid]).stdout(Stdio::null()).status();
    assert!(pinned.is_ok_and(|s| s.success()), "taskset could not pin a thread to core 0");
}

/// The direct baseline run from the router's core: a thread of its own on core 0 (the mock
/// workers stay on core 1), so that each call crosses cores as the router's do. What the
/// router adds beyond it is its own work; the difference between the two baselines is what
/// waking the other core costs.
async fn direct_from_core0(prefill: &[String], decode: &[String], w: &Workload, c: usize, secs: f64) -> Vec<f64> {
    let (prefill, decode, w) = (prefill.to_vec(), decode.to_vec(), w.clone());
    let (tx, rx) = tokio::sync::oneshot::channel();
    std::thread::spawn(move || {
        pin_this_thread_to_core0();
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
        let _ = tx.send(rt.block_on(direct(&prefill, &decode, &w, c, secs)));
    });
    rx.await.expect("core-0 load")
}

/// One cell's latencies (seconds) on each path, and the router's CPU seconds, wall seconds and
/// refused requests while the load ran through it.
#[derive(Default)]
struct Cell {
    router: Vec<f64>,
    cpu: f64,
    wall: f64,
    refused: usize,
    dir: Vec<f64>,
    dir0: Vec<f64>,
    null: Vec<f64>,
    /// The router's [`PHASES`] over its slices: seconds summed, requests counted.
    phases: [(f64, f64); 5],
}

impl Cell {
    /// One slice of `secs` on each path in turn: through the router, direct, direct from the
    /// router's core, through the null proxy. A cell is several slices, so that the host's
    /// drift (this machine's speed moves within seconds) falls on every path alike.
    async fn add_slice(
        &mut self,
        router: &Router,
        null: &null_proxy::NullProxy,
        (prefill, decode): (&[String], &[String]),
        w: &Workload,
        c: usize,
        secs: f64,
    ) {
        let pid = router.child.id();
        let before = router_phases(&router.http).await;
        let cpu0 = router_cpu(pid);
        let t = Instant::now();
        let (lat, failed, refused) = through_router(&router.http, w, c, secs).await;
        self.wall += t.elapsed().as_secs_f64();
        self.cpu += router_cpu(pid) - cpu0;
        let after = router_phases(&router.http).await;
        for ((sum, n), ((s1, n1), (s0, n0))) in self.phases.iter_mut().zip(after.into_iter().zip(before)) {
            (*sum, *n) = (*sum + s1 - s0, *n + n1 - n0);
        }
        assert_eq!(failed, 0, "{failed} requests failed at c = {c}");
        self.router.extend(lat);
        self.refused += refused;
        self.dir.extend(direct(prefill, decode, w, c, secs).await);
        self.dir0.extend(direct_from_core0(prefill, decode, w, c, secs).await);
        let (lat, failed, _) = through_router(&null.addr, w, c, secs).await;
        assert_eq!(failed, 0, "{failed} requests through the null proxy failed at c = {c}");
        self.null.extend(lat);
    }
}

fn main() {
    let quick = ferry_core::bench::quick();
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    assert!(cores >= 2, "W3 needs two cores (router on one, workers and load on the other)");
    // This process (the mock workers and the load) on core 1, the router on core 0.
    let pinned = Command::new("taskset")
        .args(["-a", "-p", "-c", "1", &std::process::id().to_string()])
        .stdout(Stdio::null())
        .status()
        .expect("taskset");
    assert!(pinned.success(), "taskset could not pin the bench to core 1");
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    rt.block_on(run(quick));
}

async fn run(quick: bool) {
    let path = model_path();
    assert!(path.exists(), "{} is missing: run `cargo run -p ferry -- model fetch smollm2-135m`", path.display());
    let model = ServedModel::load(&path).expect("model");
    let loads = workloads(&model);
    let mut prefill = Vec::new();
    for _ in 0..prefill_workers() {
        prefill.push(mock_workers::serve("prefill").await);
    }
    let mut decode = Vec::new();
    for _ in 0..DECODE_WORKERS {
        decode.push(mock_workers::serve("decode").await);
    }
    let (secs, levels): (f64, &[usize]) = if quick { (0.5, &[1, 8]) } else { (3.0, &[1, 8, 32, 128]) };
    let secs = std::env::var("FERRY_BENCH_SECS").ok().and_then(|v| v.parse().ok()).unwrap_or(secs);
    let levels: Vec<usize> = match std::env::var("FERRY_BENCH_C") {
        Ok(v) => v.split(',').map(|c| c.trim().parse().expect("FERRY_BENCH_C: comma-separated numbers")).collect(),
        Err(_) => levels.to_vec(),
    };
    // Slices of at most 0.5 s per path, interleaved; FERRY_BENCH_SLICES=1 runs each path's
    // whole cell at once (for profiling the router over one long run).
    let slices: usize = std::env::var("FERRY_BENCH_SLICES")
        .ok()
        .map(|v| v.parse().expect("FERRY_BENCH_SLICES: a number"))
        .unwrap_or((secs / 0.5).ceil() as usize)
        .max(1);
    let only = std::env::var("FERRY_BENCH_ONLY").ok();
    let keep = |tag: &str| only.as_deref().is_none_or(|o| o.split(',').any(|t| t.trim() == tag));
    println!(
        "router pinned to core 0; {} prefill + {DECODE_WORKERS} decode mock workers and the load on core 1; {secs} s per cell and path, in {slices} interleaved slices",
        prefill.len()
    );
    println!(
        "smg (issue 17, this machine): 16 KB chat on raw text 4.7 k req/s/core, 209 us CPU/request; 4.5 k-token prompt with tokenization 478 req/s/core, 2.08 ms CPU/request"
    );
    let runs = [
        (&loads[0], 64, "head cache on", "chat"),
        (&loads[0], 0, "head cache off", "chat-nocache"),
        (&loads[1], 64, "", "completions"),
        (&loads[2], 64, "", "short"),
    ];
    for (w, cache, note, _) in runs.into_iter().filter(|r| keep(r.3)) {
        let router = start_router(&path, &prefill, &decode, cache).await;
        let pid = router.child.id();
        let null = null_proxy::start(&prefill[0], &decode[0], &w.ids, OUTPUT_TOKENS);
        // Warm up: connections, the head cache's shared system prompt, allocator.
        through_router(&router.http, w, 2, if quick { 0.2 } else { 1.0 }).await;
        through_router(&null.addr, w, 2, if quick { 0.2 } else { 1.0 }).await;
        println!("\n{} {note}", w.name);
        println!(
            "{:>4} {:>8} {:>7} {:>10} {:>12} {:>8} {:>8} {:>9} {:>9} {:>9} {:>9} {:>7} {:>7} {:>8} {:>8} {:>9} {:>8}",
            "c",
            "req/s",
            "cpu %",
            "cpu us/req",
            "req/s/core",
            "p50 ms",
            "p99 ms",
            "dir p50",
            "dir p99",
            "+p50 ms",
            "+p99 ms",
            "RSS MB",
            "busy %",
            "dir0 p50",
            "+p50/0",
            "null +p50",
            "work p50"
        );
        for &c in &levels {
            let mut cell = Cell::default();
            for _ in 0..slices {
                cell.add_slice(&router, &null, (&prefill, &decode), w, c, secs / slices as f64).await;
            }
            let Cell { router: mut lat, cpu, wall, refused, mut dir, mut dir0, null: mut nulls, phases } = cell;
            let n = lat.len() as f64;
            let (p50, p99) = (pct(&mut lat, 0.5) * 1e3, pct(&mut lat, 0.99) * 1e3);
            let (d50, d99) = (pct(&mut dir, 0.5) * 1e3, pct(&mut dir, 0.99) * 1e3);
            let f50 = pct(&mut dir0, 0.5) * 1e3;
            let n50 = pct(&mut nulls, 0.5) * 1e3;
            println!(
                "{c:>4} {:>8.0} {:>7.0} {:>10.0} {:>12.0} {p50:>8.2} {p99:>8.2} {d50:>9.2} {d99:>9.2} {:>9.2} {:>9.2} {:>7.0} {:>7.1} {f50:>8.2} {:>8.2} {:>9.2} {:>8.2}",
                n / wall,
                cpu / wall * 100.0,
                cpu / n * 1e6,
                n / cpu,
                p50 - d50,
                p99 - d99,
                rss_mb(pid, "VmRSS"),
                100.0 * refused as f64 / (n + refused as f64),
                p50 - f50,
                n50 - d50,
                p50 - n50
            );
            let means: Vec<String> = PHASES
                .iter()
                .zip(phases)
                .map(|(p, (s, n))| format!("{p} {:.0}", if n > 0.0 { s / n * 1e6 } else { 0.0 }))
                .collect();
            println!("{:>4} router phases, mean us: {}", "", means.join(", "));
        }
        println!(
            "router peak RSS {:.0} MB; GET /health at c = 1: p50 {:.3} ms (the HTTP hop alone)",
            rss_mb(pid, "VmHWM"),
            health_p50(&router.http, secs.min(1.0)).await
        );
    }
}
