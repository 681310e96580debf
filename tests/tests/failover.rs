//! A worker the router's health checks take out of placement, or that leaves the cluster,
//! while it holds a request's call before the first token loses the call: the request is
//! retried elsewhere at once and completes with the colocated engine's tokens.
//!
//! After its first token a request cannot be retried: its decode stream ends with a retriable
//! UNAVAILABLE once the worker is out, the stream silent and the worker not answering at all
//! (a draining worker answers, and keeps its streams).
//!
//! Before, the call waited on the worker: for ever on one whose process still answers HTTP/2
//! pings but not the call (these tests), ~8 s on a frozen one (the pings' interval and
//! timeout; the chaos suite's SIGSTOP phase), though the router stopped placing on it within
//! ~0.3 s.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use ferry_cluster::discovery::Role;
use ferry_proto::v1 as pb;
use ferry_tests::{TinyModel, greedy, metric_sum, scrape, settle, settle_decode, until};
use tonic::{Request, Response, Status};
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::{HealthCheckRequest, HealthCheckResponse};

/// A worker that takes every call and answers none of them (its health checks and load
/// reports are answered), counting the calls taken.
#[derive(Clone, Default)]
struct Silent {
    calls: Arc<AtomicUsize>,
    /// A decode call gets its response headers (then nothing); otherwise not even those, as
    /// from a frozen process.
    headers: bool,
    /// A decode call gets its headers and one token, then nothing (a process frozen after
    /// its first token).
    one_token: bool,
}

#[tonic::async_trait]
impl pb::prefill_server::Prefill for Silent {
    async fn prefill(&self, _: Request<pb::PrefillRequest>) -> Result<Response<pb::PrefillResponse>, Status> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        std::future::pending().await
    }

    async fn abort(&self, _: Request<pb::AbortRequest>) -> Result<Response<pb::AbortResponse>, Status> {
        Ok(Response::new(pb::AbortResponse { found: false }))
    }
}

#[tonic::async_trait]
impl pb::bootstrap_server::Bootstrap for Silent {
    async fn handshake(&self, _: Request<pb::HandshakeRequest>) -> Result<Response<pb::HandshakeResponse>, Status> {
        std::future::pending().await
    }
}

#[tonic::async_trait]
impl pb::decode_server::Decode for Silent {
    type GenerateStream = futures::stream::BoxStream<'static, Result<pb::DecodeResponse, Status>>;

    async fn generate(&self, _: Request<pb::DecodeRequest>) -> Result<Response<Self::GenerateStream>, Status> {
        use futures::StreamExt;
        self.calls.fetch_add(1, Ordering::SeqCst);
        if self.one_token {
            let token = pb::DecodeResponse {
                token_ids: vec![7],
                logprobs: vec![pb::TokenLogprob { token_id: 7, logprob: 0.0 }],
                ..Default::default()
            };
            return Ok(Response::new(
                futures::stream::once(async { Ok(token) }).chain(futures::stream::pending()).boxed(),
            ));
        }
        if !self.headers {
            std::future::pending::<()>().await;
        }
        Ok(Response::new(futures::stream::pending().boxed()))
    }

    async fn abort(&self, _: Request<pb::AbortRequest>) -> Result<Response<pb::AbortResponse>, Status> {
        Ok(Response::new(pb::AbortResponse { found: false }))
    }
}

#[tonic::async_trait]
impl pb::load_server::Load for Silent {
    /// Roomier than any real worker here, so that placement picks it.
    async fn report(&self, _: Request<pb::LoadRequest>) -> Result<Response<pb::LoadReport>, Status> {
        Ok(Response::new(pb::LoadReport { free_pages: 1 << 20, total_pages: 1 << 20, ..Default::default() }))
    }
}

/// The silent worker's health service: SERVING, or NOT_SERVING once told (as a worker says
/// while it drains), or no answer at all once frozen (as from a stopped process, whose
/// connections stay up).
#[derive(Clone, Default)]
struct Checks {
    not_serving: Arc<AtomicBool>,
    frozen: Arc<AtomicBool>,
    /// Checks fail at once, as new calls to a server shutting down gracefully do.
    refusing: Arc<AtomicBool>,
}

impl Checks {
    fn not_serving(&self) {
        self.not_serving.store(true, Ordering::SeqCst);
    }

    fn freeze(&self) {
        self.frozen.store(true, Ordering::SeqCst);
    }

    fn refuse(&self) {
        self.refusing.store(true, Ordering::SeqCst);
    }
}

#[tonic::async_trait]
impl tonic_health::pb::health_server::Health for Checks {
    async fn check(&self, _: Request<HealthCheckRequest>) -> Result<Response<HealthCheckResponse>, Status> {
        if self.frozen.load(Ordering::SeqCst) {
            std::future::pending::<()>().await;
        }
        if self.refusing.load(Ordering::SeqCst) {
            return Err(Status::unavailable("the server is shutting down"));
        }
        let status =
            if self.not_serving.load(Ordering::SeqCst) { ServingStatus::NotServing } else { ServingStatus::Serving };
        Ok(Response::new(HealthCheckResponse { status: status as i32 }))
    }

    type WatchStream = futures::stream::Pending<Result<HealthCheckResponse, Status>>;

    async fn watch(&self, _: Request<HealthCheckRequest>) -> Result<Response<Self::WatchStream>, Status> {
        Err(Status::unimplemented("watch"))
    }
}

/// Serves `s` (every service but the one a role lacks is harmless) on a free port, with the
/// health service returned.
async fn serve(s: Silent) -> (SocketAddr, Checks) {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = l.local_addr().expect("addr");
    let checks = Checks::default();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(tonic_health::pb::health_server::HealthServer::new(checks.clone()))
            .add_service(pb::prefill_server::PrefillServer::new(s.clone()))
            .add_service(pb::bootstrap_server::BootstrapServer::new(s.clone()))
            .add_service(pb::decode_server::DecodeServer::new(s.clone()))
            .add_service(pb::load_server::LoadServer::new(s))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(l)),
    );
    (addr, checks)
}

/// The tests here one at a time: the routers' metrics are the process's, and each test counts
/// its own retries.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn prompt(n: usize) -> Vec<u32> {
    (0..n).map(|i| ((i * 31 + 7) % 350) as u32).collect()
}

/// Workers that give up on nothing on their own within the test (a room they time out would
/// fail the call, and the router would retry it anyway).
fn patient(w: &mut ferry_worker::WorkerArgs) {
    w.pool_pages = 1024;
    w.bootstrap_timeout = 60.0;
    w.waiting_timeout = 60.0;
    w.transfer_timeout = 60.0;
}

/// Sends a request through router `r` and, once the silent worker took its call, `fault`;
/// the request must complete within 30 s with the colocated engine's tokens, and the router
/// must count one retry of `stage`.
async fn request_outlives_the_silent_worker(
    m: &TinyModel,
    r: &ferry_router::Running,
    silent: &Silent,
    fault: impl std::future::Future<Output = ()>,
    stage: &str,
) {
    let tokens = prompt(100);
    let want = ferry_tests::colocated(&m.path(), std::slice::from_ref(&tokens), &greedy(4));
    let label = format!("stage=\"{stage}\"");
    let before = metric_sum(&scrape(r.metrics_addr).await, "ferry_router_retries_total", &label);
    let (addr, sent) = (r.grpc_addr, tokens.clone());
    let request = tokio::spawn(async move { ferry_tests::routed(addr, &sent, &greedy(4)).await });
    until("the silent worker took the call", || silent.calls.load(Ordering::SeqCst) > 0).await;
    fault.await;
    let (got, _) = tokio::time::timeout(Duration::from_secs(30), request)
        .await
        .expect("the request waited on the worker its health checks took out")
        .expect("request task");
    assert_eq!(got, want[0], "retried elsewhere");
    let body = scrape(r.metrics_addr).await;
    let retries: Vec<&str> = body.lines().filter(|l| l.starts_with("ferry_router_retries_total")).collect();
    assert_eq!(metric_sum(&body, "ferry_router_retries_total", &label) - before, 1.0, "{retries:?}");
}

/// A silent prefill worker, a patient decode worker and a router over them, all healthy.
struct SilentPrefill {
    m: TinyModel,
    d: ferry_decode::Running,
    silent: Silent,
    health: Checks,
    r: ferry_router::Running,
}

impl SilentPrefill {
    async fn start() -> Self {
        let m = TinyModel::new();
        let mut da = ferry_decode::DecodeArgs::for_model(m.path());
        patient(&mut da.worker);
        let d = ferry_decode::start(da).await.expect("decode up");
        let silent = Silent::default();
        let (addr, health) = serve(silent.clone()).await;
        let mut ra = ferry_router::RouterArgs::new(m.path(), vec![addr.to_string()], vec![d.grpc_addr.to_string()]);
        // The prompt goes to the prefill worker, not computed on the decode worker: the retry
        // then computes it there (no other prefill worker).
        (ra.local_prefill_below, ra.local_prefill_max) = (0, 0);
        let r = ferry_router::start(ra).await.expect("router up");
        until("both workers healthy", || r.ready(1, 1)).await;
        Self { m, d, silent, health, r }
    }

    /// Checks the decode worker's pages are back, then stops.
    async fn stop(self) {
        settle_decode(std::slice::from_ref(&self.d)).await;
        self.r.stop().await;
        self.d.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_worker_taken_out_mid_call_loses_the_call_to_a_retry() {
    let _one = ONE_AT_A_TIME.lock().await;
    let c = SilentPrefill::start().await;
    let unhealthy = async { c.health.not_serving() };
    request_outlives_the_silent_worker(&c.m, &c.r, &c.silent, unhealthy, "prefill").await;
    c.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_worker_taken_out_before_its_answer_loses_the_call_to_a_retry() {
    decode_taken_out(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_worker_taken_out_before_the_first_token_loses_the_call_to_a_retry() {
    decode_taken_out(true).await;
}

/// A silent decode worker (its response headers sent when `headers`) taken out of placement
/// while it holds a request's decode call.
async fn decode_taken_out(headers: bool) {
    let _one = ONE_AT_A_TIME.lock().await;
    let m = TinyModel::new();
    let mut pa = ferry_prefill::PrefillArgs::for_model(m.path());
    patient(&mut pa.worker);
    let p = ferry_prefill::start(pa).await.expect("prefill up");
    let mut da = ferry_decode::DecodeArgs::for_model(m.path());
    patient(&mut da.worker);
    let d = ferry_decode::start(da).await.expect("decode up");
    let silent = Silent { headers, ..Silent::default() };
    let (addr, health) = serve(silent.clone()).await;
    // The silent decode worker reports the most room: the request goes there first.
    let mut ra = ferry_router::RouterArgs::new(
        m.path(),
        vec![p.grpc_addr.to_string()],
        vec![addr.to_string(), d.grpc_addr.to_string()],
    );
    (ra.local_prefill_below, ra.local_prefill_max) = (0, 0);
    let r = ferry_router::start(ra).await.expect("router up");
    until("every worker healthy", || r.ready(1, 2)).await;
    let unhealthy = async { health.not_serving() };
    request_outlives_the_silent_worker(&m, &r, &silent, unhealthy, "decode").await;
    settle(&p, std::slice::from_ref(&d)).await;
    r.stop().await;
    p.stop().await;
    d.stop().await;
}

/// The same when the prefill worker leaves the cluster (its etcd lease expired: a frozen
/// process renews nothing) before its health checks fail: its calls end with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_worker_that_leaves_mid_call_loses_the_call_to_a_retry() {
    let _one = ONE_AT_A_TIME.lock().await;
    let c = SilentPrefill::start().await;
    let id = c.r.workers().snapshot().prefill[0].as_ref().expect("the prefill worker").id.clone();
    let leaves = async { assert!(c.r.workers().remove(Role::Prefill, &id), "removed") };
    request_outlives_the_silent_worker(&c.m, &c.r, &c.silent, leaves, "prefill").await;
    c.stop().await;
}

/// A router over a prefill worker and a decode worker that sends one token, then nothing,
/// and a request's stream through it once that token arrived.
struct OneToken {
    p: ferry_prefill::Running,
    health: Checks,
    addr: SocketAddr,
    r: ferry_router::Running,
    stream: tonic::Streaming<pb::GenerateResponse>,
}

impl OneToken {
    async fn start() -> Self {
        let m = TinyModel::new();
        let mut pa = ferry_prefill::PrefillArgs::for_model(m.path());
        patient(&mut pa.worker);
        let p = ferry_prefill::start(pa).await.expect("prefill up");
        let silent = Silent { one_token: true, ..Silent::default() };
        let (addr, health) = serve(silent).await;
        let mut ra = ferry_router::RouterArgs::new(m.path(), vec![p.grpc_addr.to_string()], vec![addr.to_string()]);
        (ra.local_prefill_below, ra.local_prefill_max) = (0, 0);
        let r = ferry_router::start(ra).await.expect("router up");
        until("both workers healthy", || r.ready(1, 1)).await;
        let mut c = pb::router_client::RouterClient::new(ferry_tests::channel(r.grpc_addr).await);
        let req = pb::GenerateRequest {
            prompt: Some(pb::generate_request::Prompt::TokenIds(pb::TokenIds { ids: prompt(100) })),
            sampling: Some(ferry_cluster::wire::sampling_to_proto(&greedy(4))),
            return_token_ids: true,
            ..Default::default()
        };
        let mut stream = c.generate(req).await.expect("generate").into_inner();
        // The first message may carry the request's id alone.
        let mut tokens = Vec::new();
        while tokens.is_empty() {
            let m =
                tokio::time::timeout(Duration::from_secs(30), stream.message()).await.expect("the first token in time");
            tokens = m.expect("the first token").expect("a message").token_ids;
        }
        assert_eq!(tokens, vec![7], "the silent worker's token");
        Self { p, health, addr, r, stream }
    }

    async fn stop(self) {
        drop(self.stream);
        self.r.stop().await;
        self.p.stop().await;
    }
}

/// A decode worker that sent a token, then stopped answering anything (frozen), taken out of
/// placement by its health checks: the request cannot be retried (a token went out) and ends
/// with a retriable UNAVAILABLE naming the worker once a last health check goes unanswered.
/// Before, the stream waited on the HTTP/2 pings: for ever here (this process still answers
/// them), ~8 s on a frozen one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_stream_silent_after_its_worker_froze_ends() {
    let _one = ONE_AT_A_TIME.lock().await;
    let mut c = OneToken::start().await;
    c.health.freeze();
    let since = std::time::Instant::now();
    let end = tokio::time::timeout(Duration::from_secs(30), c.stream.message())
        .await
        .expect("the stream waited on the worker its health checks took out");
    let err = end.expect_err("the stream ends with an error, not a finish");
    let waited = since.elapsed();
    assert_eq!(err.code(), tonic::Code::Unavailable, "{err:?}");
    assert!(err.message().contains(&c.addr.to_string()), "{err:?}");
    // Three unanswered checks (a second's timeout each) and one more: under the pings' 8 s.
    assert!(waited < Duration::from_secs(8), "ended after {waited:?}");
    c.stop().await;
}

/// A decode worker draining on its way out says NOT_SERVING and leaves the registry, then
/// finishes its requests: its streams go on, however long they are silent (a request there may
/// be queued or retracted), because it still answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_stream_of_a_draining_worker_goes_on() {
    let _one = ONE_AT_A_TIME.lock().await;
    let mut c = OneToken::start().await;
    c.health.not_serving();
    until("the worker out of placement", || !c.r.ready(1, 1)).await;
    let id = c.r.workers().snapshot().decode[0].id.clone();
    assert!(c.r.workers().remove(Role::Decode, &id), "removed");
    let end = tokio::time::timeout(Duration::from_secs(3), c.stream.message()).await;
    assert!(end.is_err(), "the stream of a draining worker ended: {end:?}");
    c.stop().await;
}

/// The same when the draining worker's server, shutting down gracefully, refuses new calls
/// (the router's checks among them) while its open streams go on: a refusal is an answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_stream_of_a_worker_refusing_new_calls_goes_on() {
    let _one = ONE_AT_A_TIME.lock().await;
    let mut c = OneToken::start().await;
    c.health.refuse();
    until("the worker out of placement", || !c.r.ready(1, 1)).await;
    let end = tokio::time::timeout(Duration::from_secs(3), c.stream.message()).await;
    assert!(end.is_err(), "the stream of a worker refusing new calls ended: {end:?}");
    c.stop().await;
}
