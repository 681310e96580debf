//! Steady load through the router, the way a careful client sends it: each request gets a
//! deadline, and an attempt that fails with a retriable status (or cannot reach the router)
//! is sent again after a short backoff. A request's outcome is recorded against the phase in
//! which it was first sent; errors, retries and hung attempts against the phase in which they
//! happened.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ferry_proto::v1 as pb;
use tonic::Code;

/// A request's whole life, retries included, must fit in this.
pub const REQUEST_DEADLINE: Duration = Duration::from_secs(60);
/// One attempt must end (with tokens or an error) within this, or it counts as hung.
pub const ATTEMPT_TIMEOUT: Duration = Duration::from_secs(40);

/// Outcomes of the requests first sent in one phase.
#[derive(Debug, Default, Clone)]
pub struct Tally {
    /// Requests sent.
    pub sent: u64,
    /// Completed with the reference tokens.
    pub completed: u64,
    /// Completed with other tokens (must be 0).
    pub wrong: u64,
    /// Ended with a non-retriable error.
    pub failed: u64,
    /// Errors by kind that happened in this phase (retriable ones were followed by a retry
    /// while the deadline allowed).
    pub errors: BTreeMap<String, u64>,
    /// Attempts sent again in this phase.
    pub retried: u64,
    /// Attempts in this phase that neither answered nor failed within [`ATTEMPT_TIMEOUT`]
    /// (must be 0).
    pub hung: u64,
    /// Requests with no result by their deadline (must be 0).
    pub lost: u64,
    /// End-to-end seconds of completed requests.
    pub latencies: Vec<f64>,
    /// The slowest completed request: its end-to-end seconds and request id (the router's
    /// and workers' logs name it).
    pub slowest: Option<(f64, String)>,
}

/// Request `n` in [`Load::older_than`]'s map while this lives, however its task ends.
struct InFlight<'a>(&'a Mutex<HashMap<u64, Instant>>, u64);

impl<'a> InFlight<'a> {
    fn new(map: &'a Mutex<HashMap<u64, Instant>>, n: u64) -> Self {
        map.lock().expect("in flight").insert(n, Instant::now());
        Self(map, n)
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        if let Ok(mut map) = self.0.lock() {
            map.remove(&self.1);
        }
    }
}

/// The load generator's shared state.
pub struct Load {
    phase: Mutex<String>,
    tallies: Mutex<BTreeMap<String, Tally>>,
    order: Mutex<Vec<String>>,
    stop: AtomicBool,
    next_id: AtomicU64,
    /// When each request still unanswered was first sent, by its number.
    in_flight: Mutex<HashMap<u64, Instant>>,
}

/// What a client retries, as docs/reliability.md says: `UNAVAILABLE` (Ferry's answer to every
/// fault it cannot hide, and a router that cannot be reached), `RESOURCE_EXHAUSTED` (back
/// pressure) and `UNKNOWN` (an HTTP/2 transport error: a router gone mid-stream). Any other
/// status fails the request: Ferry's fault handling must not answer `ABORTED`, `CANCELLED` or
/// `DEADLINE_EXCEEDED` to a client that did nothing wrong.
fn retriable(code: Code) -> bool {
    matches!(code, Code::Unavailable | Code::ResourceExhausted | Code::Unknown)
}

/// A short name for an error: its code and the first words of its message.
fn kind(s: &tonic::Status) -> String {
    let msg: String = s.message().split_whitespace().take(4).collect::<Vec<_>>().join(" ");
    format!("{:?}: {msg}", s.code())
}

async fn attempt(router: &str, id: &str, prompt: &[u32], max_tokens: u32) -> Result<Vec<u32>, tonic::Status> {
    let ch = tonic::transport::Endpoint::from_shared(format!("http://{router}"))
        .map_err(|e| tonic::Status::internal(e.to_string()))?
        .connect_timeout(Duration::from_secs(2))
        .connect()
        .await
        .map_err(|_| tonic::Status::unavailable("router unreachable"))?;
    let req = pb::GenerateRequest {
        request_id: id.into(),
        prompt: Some(pb::generate_request::Prompt::TokenIds(pb::TokenIds { ids: prompt.to_vec() })),
        sampling: Some(ferry_cluster::wire::sampling_to_proto(&ferry_tests::greedy(max_tokens))),
        return_token_ids: true,
        ..Default::default()
    };
    let mut s = pb::router_client::RouterClient::new(ch).generate(req).await?.into_inner();
    let mut out = Vec::new();
    while let Some(m) = s.message().await? {
        out.extend(m.token_ids);
    }
    Ok(out)
}

impl Load {
    /// Starts in phase `first`.
    pub fn new(first: &str) -> Arc<Self> {
        Arc::new(Self {
            phase: Mutex::new(first.into()),
            tallies: Mutex::new(BTreeMap::new()),
            order: Mutex::new(vec![first.into()]),
            stop: AtomicBool::new(false),
            next_id: AtomicU64::new(0),
            in_flight: Mutex::new(HashMap::new()),
        })
    }

    /// Requests sent from now on count for `name`.
    pub fn phase(&self, name: &str) {
        *self.phase.lock().expect("phase") = name.into();
        self.order.lock().expect("order").push(name.into());
    }

    /// Waits (up to `within`) until the current phase has sent a request, so that every
    /// phase measures requests sent after its fault too: under memory pressure a request takes
    /// seconds, and clients busy retrying the ones a fault hit may send nothing new for a while.
    pub async fn wait_sent(&self, within: Duration) {
        let t = Instant::now();
        while t.elapsed() < within {
            let phase = self.now();
            if self.tallies.lock().expect("tallies").get(&phase).is_some_and(|t| t.sent > 0) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    fn record(&self, phase: &str, f: impl FnOnce(&mut Tally)) {
        f(self.tallies.lock().expect("tallies").entry(phase.into()).or_default());
    }

    /// `clients` closed-loop clients sending `prompts` (with their reference outputs) in turn.
    pub fn spawn(
        self: &Arc<Self>,
        clients: usize,
        router: String,
        prompts: Arc<Vec<(Vec<u32>, Vec<u32>)>>,
        max_tokens: u32,
    ) -> Vec<tokio::task::JoinHandle<()>> {
        (0..clients)
            .map(|c| {
                let (me, router, prompts) = (Arc::clone(self), router.clone(), Arc::clone(&prompts));
                tokio::spawn(async move {
                    let mut i = c;
                    while !me.stop.load(Ordering::SeqCst) {
                        let (prompt, want) = &prompts[i % prompts.len()];
                        i += clients;
                        me.one(&router, prompt, want, max_tokens).await;
                    }
                })
            })
            .collect()
    }

    fn now(&self) -> String {
        self.phase.lock().expect("phase").clone()
    }

    /// Requests sent more than `age` ago and still unanswered.
    pub fn older_than(&self, age: Duration) -> usize {
        self.in_flight.lock().expect("in flight").values().filter(|t| t.elapsed() > age).count()
    }

    async fn one(&self, router: &str, prompt: &[u32], want: &[u32], max_tokens: u32) {
        let n = self.next_id.fetch_add(1, Ordering::Relaxed);
        let _in_flight = InFlight::new(&self.in_flight, n);
        let phase = self.now();
        self.record(&phase, |t| t.sent += 1);
        let start = Instant::now();
        // Every attempt of a request carries the same id.
        let id = format!("chaos-{n}");
        let mut backoff = Duration::from_millis(200);
        loop {
            match tokio::time::timeout(ATTEMPT_TIMEOUT, attempt(router, &id, prompt, max_tokens)).await {
                Ok(Ok(tokens)) => {
                    let secs = start.elapsed().as_secs_f64();
                    return self.record(&phase, |t| {
                        if tokens == want {
                            t.completed += 1;
                            t.latencies.push(secs);
                            if t.slowest.as_ref().is_none_or(|s| secs > s.0) {
                                t.slowest = Some((secs, id.clone()));
                            }
                        } else {
                            t.wrong += 1;
                        }
                    });
                }
                Ok(Err(s)) if !retriable(s.code()) => {
                    self.record(&self.now(), |t| *t.errors.entry(kind(&s)).or_default() += 1);
                    return self.record(&phase, |t| t.failed += 1);
                }
                Ok(Err(s)) => self.record(&self.now(), |t| *t.errors.entry(kind(&s)).or_default() += 1),
                Err(_) => self.record(&self.now(), |t| t.hung += 1),
            }
            if start.elapsed() + backoff > REQUEST_DEADLINE {
                return self.record(&phase, |t| t.lost += 1);
            }
            self.record(&self.now(), |t| t.retried += 1);
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_secs(2));
        }
    }

    /// Stops sending new requests and waits for those running (each ends by its deadline).
    pub async fn finish(&self, tasks: Vec<tokio::task::JoinHandle<()>>) {
        self.stop.store(true, Ordering::SeqCst);
        for t in tasks {
            t.await.expect("a client task");
        }
    }

    /// The tallies in phase order.
    pub fn tallies(&self) -> Vec<(String, Tally)> {
        let t = self.tallies.lock().expect("tallies");
        let mut seen = Vec::new();
        for p in self.order.lock().expect("order").iter() {
            if !seen.iter().any(|(n, _): &(String, Tally)| n == p) {
                seen.push((p.clone(), t.get(p).cloned().unwrap_or_default()));
            }
        }
        seen
    }
}
