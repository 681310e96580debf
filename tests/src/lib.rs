//! `ferry-tests`: the cluster test harness. Real daemons run in-process on port 0 (the same
//! `start` functions the binaries call), with real gRPC and a real data plane between them;
//! [`Client`] plays the router's part for a request: mint a room, call the decode node's
//! `Generate` and the prefill node's `Prefill` concurrently, collect the tokens.

pub mod closed_loop;
pub mod daemon;
pub mod etcd;
pub mod failing_holder;
pub mod otlp;
pub mod pki;
pub mod proxy;

use std::path::{Path, PathBuf};

use ferry_cluster::RoomKey;
use ferry_engine::tiny::{TinySpec, write_hf};
use ferry_engine::{BatchOptions, Model, PagePool, Request, SamplingParams};
use ferry_kernels::cpu::CpuBackend;
use ferry_proto::v1 as pb;
use tonic::transport::Channel;

/// A tiny random Llama written to a temporary directory (removed on drop).
pub struct TinyModel {
    dir: tempfile::TempDir,
}

impl TinyModel {
    /// The default tiny model (context 2048, vocabulary 359), with its own LM head: tied to
    /// the embedding, a random model this small echoes its input token whatever the context,
    /// so its answers would not show a page of wrong K/V.
    pub fn new() -> Self {
        Self::with(TinySpec { tie: false, ..TinySpec::default() })
    }

    /// A tiny model from `spec`.
    pub fn with(spec: TinySpec) -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        write_hf(&dir.path().join("hf"), &spec).expect("write the tiny model");
        Self { dir }
    }

    /// Its HF directory.
    pub fn path(&self) -> PathBuf {
        self.dir.path().join("hf")
    }
}

impl Default for TinyModel {
    fn default() -> Self {
        Self::new()
    }
}

/// Runs a blocking wait (a process starting, say) from test code that may be on a tokio
/// worker thread. On a multi-thread runtime the worker hands its queued tasks to another
/// thread first (`block_in_place`): a plain blocking call there stalls the task in the
/// worker's LIFO slot, which no other worker steals, for as long as the wait lasts (the chaos
/// suite's clients saw 5–10 s requests while a killed daemon restarted). Elsewhere it just
/// runs `f`.
pub fn blocking<T>(f: impl FnOnce() -> T) -> T {
    use tokio::runtime::{Handle, RuntimeFlavor};
    match Handle::try_current().map(|h| h.runtime_flavor()) {
        Ok(RuntimeFlavor::MultiThread) => tokio::task::block_in_place(f),
        _ => f(),
    }
}

/// Greedy sampling of `n` tokens (EOS ignored, so every run has the same length).
pub fn greedy(n: u32) -> SamplingParams {
    SamplingParams { temperature: 0.0, max_new_tokens: n, ignore_eos: true, ..SamplingParams::default() }
}

/// What one colocated engine produces for `prompts`: the reference for every cluster test.
pub fn colocated(model: &Path, prompts: &[Vec<u32>], params: &SamplingParams) -> Vec<Vec<u32>> {
    colocated_scored(model, prompts, params).into_iter().map(|o| o.into_iter().map(|(t, _)| t).collect()).collect()
}

/// [`colocated`] with each token's logprob.
pub fn colocated_scored(model: &Path, prompts: &[Vec<u32>], params: &SamplingParams) -> Vec<Vec<(u32, f32)>> {
    let m = Model::load(model, CpuBackend::default()).expect("load model");
    let pages: usize = prompts.iter().map(|p| (p.len() + params.max_new_tokens as usize).div_ceil(16) + 1).sum();
    let mut pool = PagePool::new(m.backend(), m.kv_layout(16), pages).expect("pool");
    let reqs: Vec<Request> = prompts.iter().map(|p| Request { prompt: p.clone(), params: params.clone() }).collect();
    let out = ferry_engine::generate(&m, &mut pool, &reqs, BatchOptions::default()).expect("generate");
    out.into_iter().map(|o| o.sampled.iter().map(|s| (s.token, s.logprob)).collect()).collect()
}

/// Plays the router for single requests.
#[derive(Clone)]
pub struct Client {
    decode: pb::decode_client::DecodeClient<Channel>,
    prefill: Option<(pb::prefill_client::PrefillClient<Channel>, String)>,
    /// Sent as the prefill call's `pull_from` (empty: no pull).
    pull_from: String,
}

/// How a request ended badly.
#[derive(Debug)]
pub enum Failure {
    /// The decode stream ended with this status.
    Decode(tonic::Status),
    /// The prefill call failed with this status.
    Prefill(tonic::Status),
}

/// A gRPC channel to a daemon.
pub async fn channel(addr: std::net::SocketAddr) -> Channel {
    tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .expect("endpoint")
        .connect()
        .await
        .expect("connect to a daemon")
}

impl Client {
    /// Requests go to `decode`, prefilled on `prefill` (None: on the decode node itself).
    pub async fn new(decode: std::net::SocketAddr, prefill: Option<std::net::SocketAddr>) -> Self {
        let d = pb::decode_client::DecodeClient::new(channel(decode).await);
        let p = match prefill {
            Some(a) => Some((pb::prefill_client::PrefillClient::new(channel(a).await), a.to_string())),
            None => None,
        };
        Self { decode: d, prefill: p, pull_from: String::new() }
    }

    /// The prefill node may pull held pages from the decode node at `addr` (`pull_from`).
    pub fn pulling_from(mut self, addr: impl Into<String>) -> Self {
        self.pull_from = addr.into();
        self
    }

    /// Generates for `prompt`: returns the tokens, or how it failed.
    pub async fn generate(&self, prompt: &[u32], params: &SamplingParams) -> Result<Vec<u32>, Failure> {
        self.generate_in(RoomKey::random(), prompt, params).await
    }

    /// [`generate`](Self::generate) with each token's logprob.
    pub async fn generate_scored(&self, prompt: &[u32], params: &SamplingParams) -> Result<Vec<(u32, f32)>, Failure> {
        self.generate_scored_in(RoomKey::random(), prompt, params).await
    }

    /// Like [`generate`](Self::generate) with a chosen room.
    pub async fn generate_in(
        &self,
        key: RoomKey,
        prompt: &[u32],
        params: &SamplingParams,
    ) -> Result<Vec<u32>, Failure> {
        Ok(self.generate_scored_in(key, prompt, params).await?.into_iter().map(|(t, _)| t).collect())
    }

    async fn generate_scored_in(
        &self,
        key: RoomKey,
        prompt: &[u32],
        params: &SamplingParams,
    ) -> Result<Vec<(u32, f32)>, Failure> {
        let sampling = Some(ferry_cluster::wire::sampling_to_proto(params));
        let req = pb::DecodeRequest {
            request_id: format!("test-{}", key.room.get()),
            room: Some(ferry_cluster::wire::room_key_to_proto(&key)),
            prefill_bootstrap_addr: self.prefill.as_ref().map(|p| p.1.clone()).unwrap_or_default(),
            token_ids: prompt.to_vec(),
            sampling: sampling.clone(),
        };
        let mut d = self.decode.clone();
        let decode = async move {
            let mut stream = d.generate(req).await.map_err(Failure::Decode)?.into_inner();
            let mut out = Vec::new();
            loop {
                match stream.message().await {
                    Ok(Some(m)) => {
                        let lp = m.logprobs.iter().map(|l| l.logprob).chain(std::iter::repeat(f32::NAN));
                        out.extend(m.token_ids.into_iter().zip(lp));
                    }
                    Ok(None) => return Ok(out),
                    Err(s) => return Err(Failure::Decode(s)),
                }
            }
        };
        let prefill = async {
            let Some((p, _)) = &self.prefill else { return Ok(()) };
            let req = pb::PrefillRequest {
                request_id: format!("test-{}", key.room.get()),
                room: Some(ferry_cluster::wire::room_key_to_proto(&key)),
                token_ids: prompt.to_vec(),
                sampling,
                priority: 0,
                pull_from: self.pull_from.clone(),
            };
            p.clone().prefill(req).await.map(|_| ()).map_err(Failure::Prefill)
        };
        let (d, p) = tokio::join!(decode, prefill);
        let tokens = d?;
        p?;
        Ok(tokens)
    }
}

/// Random prompts with shared prefixes: `n` prompts of 1 to `max_len` tokens below `vocab`,
/// about half of them extending one of a few common stems.
pub fn prompts_with_shared_prefixes(n: usize, max_len: usize, vocab: u32, seed: u64) -> Vec<Vec<u32>> {
    let mut s = seed | 1;
    let mut next = move |m: u64| {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s % m.max(1)
    };
    let stems: Vec<Vec<u32>> =
        (0..3).map(|_| (0..(max_len / 2).max(1)).map(|_| next(u64::from(vocab)) as u32).collect()).collect();
    (0..n)
        .map(|i| {
            let len = 1 + next(max_len as u64) as usize;
            let mut p: Vec<u32> = if i % 2 == 0 { stems[i % 3].clone() } else { Vec::new() };
            p.truncate(len);
            while p.len() < len {
                p.push(next(u64::from(vocab)) as u32);
            }
            p
        })
        .collect()
}

/// Path of the SmolLM2 GGUF: `FERRY_SMOLLM2` or the `ferry model fetch smollm2-135m` cache
/// (`scripts/test` fetches it first).
pub fn smollm2() -> PathBuf {
    if let Ok(p) = std::env::var("FERRY_SMOLLM2") {
        return PathBuf::from(p);
    }
    let cache = std::env::var("FERRY_CACHE_DIR").map(PathBuf::from).unwrap_or_else(|_| {
        PathBuf::from(std::env::var("HOME").unwrap_or_else(|_| "/root".into())).join(".cache/ferry")
    });
    let p = cache.join("models/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(p.exists(), "{} is missing: run `cargo run -p ferry -- model fetch smollm2-135m` first", p.display());
    p
}

/// The sum of a metric's samples in a Prometheus scrape `body`: the lines of `name` that
/// contain `label` (`reason="x"`, say; "" for all). 0 when absent (a counter never
/// incremented is not exposed).
pub fn metric_sum(body: &str, name: &str, label: &str) -> f64 {
    body.lines()
        .filter(|l| l.starts_with(name) && l.contains(label))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// The body of `GET /metrics` at `addr`.
pub async fn scrape(addr: std::net::SocketAddr) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect to /metrics");
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: ferry\r\nConnection: close\r\n\r\n").await.expect("request");
    let mut out = String::new();
    s.read_to_string(&mut out).await.expect("response");
    assert!(out.starts_with("HTTP/1.1 200"), "{out}");
    out.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or_default()
}

/// Waits (up to 10 s) until every decode page is free and the prefill pool holds only
/// evictable cache with no room left; panics with the figures otherwise.
///
/// Every "pages back" check waits like this, never reads the load once: a worker answers its
/// last token, then frees the request's pages, and publishes its load report after the pass
/// (a report is a snapshot the engine thread writes between passes, not a synchronisation
/// point). A single read right after the reply saw 4,044 of 4,096 pages free once.
pub async fn settle(p: &ferry_prefill::Running, ds: &[ferry_decode::Running]) {
    settle_any(Some(p), ds).await;
}

/// [`settle`] for decode workers alone (requests prefilled on the decode node).
pub async fn settle_decode(ds: &[ferry_decode::Running]) {
    settle_any(None, ds).await;
}

async fn settle_any(p: Option<&ferry_prefill::Running>, ds: &[ferry_decode::Running]) {
    for _ in 0..1000 {
        let prefill_ok = p.is_none_or(|p| {
            let pl = p.load();
            pl.free_pages + pl.evictable_pages == pl.total_pages && pl.depth == (0, 0, 0)
        });
        let decode_ok = ds.iter().all(|d| d.load().free_pages == d.load().total_pages);
        if prefill_ok && decode_ok {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    let d: Vec<_> = ds.iter().map(|d| d.load()).collect();
    panic!("pages not back at baseline: prefill {:?}, decode {d:?}", p.map(|p| p.load()));
}

/// A minimal HTTP/1.1 call (`Connection: close`): returns the status, the headers
/// (lower-cased names) and the body, de-chunked.
pub async fn http(
    addr: std::net::SocketAddr,
    method: &str,
    path: &str,
    body: &[u8],
) -> (u16, Vec<(String, String)>, String) {
    http_with(addr, method, path, &[], body).await
}

/// [`http`] with extra request headers.
pub async fn http_with(
    addr: std::net::SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> (u16, Vec<(String, String)>, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let extra: String = headers.iter().map(|(k, v)| format!("{k}: {v}\r\n")).collect();
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: ferry\r\nContent-Type: application/json\r\nContent-Length: {}\r\n{extra}Connection: close\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).await.expect("write");
    s.write_all(body).await.expect("write");
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).await.expect("read");
    let split = raw.windows(4).position(|w| w == b"\r\n\r\n").map_or(raw.len(), |p| p + 4);
    let head = String::from_utf8_lossy(&raw[..split]).into_owned();
    let rest = &raw[split.min(raw.len())..];
    let mut lines = head.lines();
    let status = lines.next().and_then(|l| l.split(' ').nth(1)?.parse().ok()).unwrap_or(0);
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':').map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string())))
        .collect();
    let chunked = headers.iter().any(|(k, v)| k == "transfer-encoding" && v.contains("chunked"));
    let body = if chunked {
        let mut out = Vec::new();
        let mut r = rest;
        while let Some(eol) = r.windows(2).position(|w| w == b"\r\n") {
            let n =
                std::str::from_utf8(&r[..eol]).ok().and_then(|x| usize::from_str_radix(x.trim(), 16).ok()).unwrap_or(0);
            let after = &r[eol + 2..];
            if n == 0 || after.len() < n {
                break;
            }
            out.extend_from_slice(&after[..n]);
            r = after[n..].strip_prefix(b"\r\n").unwrap_or(&after[n..]);
        }
        String::from_utf8_lossy(&out).into_owned()
    } else {
        String::from_utf8_lossy(rest).into_owned()
    };
    (status, headers, body)
}

/// One prefill worker, one decode worker (pools of `pages` pages) and a router in front of
/// them, its flags adjusted by `edit`; returns once the router sees both workers healthy.
pub async fn one_of_each(
    m: &TinyModel,
    pages: usize,
    edit: impl FnOnce(&mut ferry_router::RouterArgs),
) -> (ferry_prefill::Running, ferry_decode::Running, ferry_router::Running) {
    let mut a = ferry_prefill::PrefillArgs::for_model(m.path());
    a.worker.pool_pages = pages;
    let p = ferry_prefill::start(a).await.expect("prefill up");
    let mut a = ferry_decode::DecodeArgs::for_model(m.path());
    a.worker.pool_pages = pages;
    let d = ferry_decode::start(a).await.expect("decode up");
    let r = router_for(m, &p, &d, edit).await;
    (p, d, r)
}

/// A router in front of `p` and `d`, its flags adjusted by `edit`; returns once it sees both
/// workers healthy.
pub async fn router_for(
    m: &TinyModel,
    p: &ferry_prefill::Running,
    d: &ferry_decode::Running,
    edit: impl FnOnce(&mut ferry_router::RouterArgs),
) -> ferry_router::Running {
    router_over(m, &[p.grpc_addr.to_string()], &[d.grpc_addr.to_string()], edit).await
}

/// A router in front of the workers at `prefill` and `decode` (gRPC addresses), its flags
/// adjusted by `edit`; returns once it sees them all healthy (5 s at most).
pub async fn router_over(
    m: &TinyModel,
    prefill: &[String],
    decode: &[String],
    edit: impl FnOnce(&mut ferry_router::RouterArgs),
) -> ferry_router::Running {
    let mut ra = ferry_router::RouterArgs::new(m.path(), prefill.to_vec(), decode.to_vec());
    edit(&mut ra);
    let r = ferry_router::start(ra).await.expect("router up");
    for _ in 0..500 {
        if r.ready(prefill.len(), decode.len()) {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    r
}

/// The model id the router at `addr` serves (`GET /v1/models`).
pub async fn served_model(addr: std::net::SocketAddr) -> String {
    let (_, _, models) = http(addr, "GET", "/v1/models", b"").await;
    let v: serde_json::Value = serde_json::from_str(&models).expect("JSON");
    v["data"][0]["id"].as_str().expect("a model").to_string()
}

/// Runs `tests/py/<script>` with `args`; fails the test unless it exits 0 and prints `ok`
/// (its last line says what passed). Returns what it printed.
pub async fn python(script: &str, args: &[&str], ok: &str) -> String {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("py").join(script);
    let out = tokio::process::Command::new("python3").arg(&path).args(args).output().await.expect("python3");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{script} failed:\n{text}");
    assert!(text.contains(ok), "{script}: {text}");
    text
}

/// Sends the router at `router` a `Router.Generate` of `ids` (greedy, `n` tokens) with
/// `request_id` and the caller's `traceparent` in its metadata, and reads it to its end.
pub async fn generate_traced(router: std::net::SocketAddr, request_id: &str, ids: Vec<u32>, n: u32, traceparent: &str) {
    let mut c = ferry_proto::v1::router_client::RouterClient::new(channel(router).await);
    let mut req = tonic::Request::new(ferry_proto::v1::GenerateRequest {
        request_id: request_id.into(),
        prompt: Some(ferry_proto::v1::generate_request::Prompt::TokenIds(ferry_proto::v1::TokenIds { ids })),
        sampling: Some(ferry_cluster::wire::sampling_to_proto(&greedy(n))),
        stop: Vec::new(),
        return_token_ids: true,
        return_phases: false,
    });
    req.metadata_mut().insert("traceparent", traceparent.parse().expect("ascii"));
    let mut s = c.generate(req).await.expect("generate").into_inner();
    while s.message().await.expect("stream").is_some() {}
}

/// Polls `cond` every 5 ms for up to 10 s; panics naming `what` past that.
pub async fn until(what: &str, mut cond: impl FnMut() -> bool) {
    for _ in 0..2000 {
        if cond() {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    panic!("timed out waiting for {what}");
}

/// A `Router.Generate` of `prompt` through the router at `addr`: the
/// tokens and the prompt tokens the serving workers found cached.
pub async fn routed(addr: std::net::SocketAddr, prompt: &[u32], params: &SamplingParams) -> (Vec<u32>, u32) {
    let mut c = pb::router_client::RouterClient::new(channel(addr).await);
    let req = pb::GenerateRequest {
        request_id: String::new(),
        prompt: Some(pb::generate_request::Prompt::TokenIds(pb::TokenIds { ids: prompt.to_vec() })),
        sampling: Some(ferry_cluster::wire::sampling_to_proto(params)),
        stop: Vec::new(),
        return_token_ids: true,
        return_phases: false,
    };
    let mut s = c.generate(req).await.expect("generate").into_inner();
    let (mut out, mut cached) = (Vec::new(), 0);
    while let Some(m) = s.message().await.expect("stream") {
        out.extend(m.token_ids);
        cached = cached.max(m.cached_tokens);
    }
    (out, cached)
}

/// Waits until every router's decode index holds `tokens` on some decode worker (their KV
/// events reached it).
pub async fn seen(routers: &[&ferry_router::Running], tokens: &[u32]) {
    for _ in 0..500 {
        let known = |r: &&ferry_router::Running| {
            let slots = r.workers().snapshot().decode.len();
            r.workers().decode_index().matched(tokens, slots).contains(&tokens.len())
        };
        if routers.iter().all(known) {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    panic!("the routers never saw the decode workers' cache events");
}

/// A prefill daemon on the tiny model with a pool of 256 pages (the decode-cache and pull
/// tests' size).
pub async fn prefill_256(m: &TinyModel) -> ferry_prefill::Running {
    let mut a = ferry_prefill::PrefillArgs::for_model(m.path());
    a.worker.pool_pages = 256;
    ferry_prefill::start(a).await.expect("prefill up")
}

/// A decode daemon on the tiny model with a pool of 256 pages, its prefix cache on or off.
pub async fn decode_256(m: &TinyModel, cache: bool) -> ferry_decode::Running {
    let mut a = ferry_decode::DecodeArgs::for_model(m.path());
    a.worker.pool_pages = 256;
    a.disable_decode_cache = !cache;
    ferry_decode::start(a).await.expect("decode up")
}
