//! A cluster of real processes for the chaos suite: etcd, `ferry prefill` ×2, `ferry decode`
//! ×2 (each decode node's data plane reached through a cuttable, delayable proxy) and
//! `ferry router`, all on fixed loopback ports so that a killed process restarts where it was.

use std::time::{Duration, Instant};

use ferry_proto::v1 as pb;
use ferry_tests::etcd::Etcd;
use ferry_tests::proxy::Proxy;

pub use ferry_tests::daemon::Daemon;

/// The `ferry` binary Cargo built for these tests.
const FERRY: &str = env!("CARGO_BIN_EXE_ferry");

/// The whole cluster.
pub struct Cluster {
    /// etcd.
    pub etcd: Etcd,
    /// Prefill daemons.
    pub prefill: Vec<Daemon>,
    /// Decode daemons.
    pub decode: Vec<Daemon>,
    /// The data-plane proxies in front of the decode daemons.
    pub proxies: Vec<Proxy>,
    /// The router.
    pub router: Daemon,
    /// The router's gRPC address.
    pub router_grpc: String,
    /// The router's `/metrics` address.
    pub router_metrics: String,
    /// The decode daemons' `/metrics` addresses.
    pub decode_metrics: Vec<String>,
    /// Each decode daemon's own data-plane address (behind its proxy).
    pub decode_data: Vec<String>,
}

/// Fixed ports for the daemons, held (bound) until the daemons start. They are drawn below
/// the kernel's ephemeral range (32768 and up on Linux), so that no outgoing connection (a
/// worker's to etcd, say) can take one between our choice and a daemon's bind, nor while a
/// killed daemon is down before its restart.
struct Ports(Vec<std::net::TcpListener>);

impl Ports {
    fn take(&mut self) -> String {
        loop {
            // free_port draws below the ephemeral range; hold it until the daemons start.
            let port = ferry_tests::etcd::free_port();
            if let Ok(l) = std::net::TcpListener::bind(("127.0.0.1", port)) {
                self.0.push(l);
                return format!("127.0.0.1:{port}");
            }
        }
    }
}

fn strings(a: &[&str]) -> Vec<String> {
    a.iter().map(|s| s.to_string()).collect()
}

impl Cluster {
    /// Starts everything with the model at `model`.
    pub async fn start(model: &std::path::Path) -> Self {
        let etcd = Etcd::start();
        let model = model.display().to_string();
        let common = |role: &str, id: &str, grpc: &str, metrics: &str, pages: &str| {
            // Plaintext between the daemons: the suite's direct callers play outsiders.
            let mut a =
                strings(&[role, "--model", &model, "--worker-id", id, "--grpc-addr", grpc, "--insecure-internal"]);
            a.extend(strings(&["--metrics-addr", metrics, "--pool-pages", pages, "--page-size", "8"]));
            a.extend(strings(&["--etcd", &etcd.endpoint(), "--cluster", "chaos", "--etcd-lease-ttl", "2"]));
            // Short enough that a stuck room ends well inside the clients' 60 s.
            a.extend(strings(&["--transfer-timeout", "10", "--bootstrap-timeout", "10"]));
            a
        };
        let mut ports = Ports(Vec::new());
        let mut prefill = Vec::new();
        for i in 0..2 {
            let (id, grpc) = (format!("p{i}"), ports.take());
            prefill.push(Daemon::new(FERRY, &id, common("prefill", &id, &grpc, "127.0.0.1:0", "384"), grpc));
        }
        let (mut decode, mut proxies, mut decode_metrics, mut decode_data) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for i in 0..2 {
            let (id, grpc, data, metrics) = (format!("d{i}"), ports.take(), ports.take(), ports.take());
            let proxy = Proxy::start(data.clone()).await;
            // Pages of 8 tokens; decode pools of 24 pages, admitting on the prompt's pages
            // alone: two requests (prompts of 67–69 tokens, 9 pages) fit a node, but not
            // their answers (32 tokens, 4 pages more each), so a node holding two retracts
            // one. Retractions then happen all through the run, under every fault.
            let mut a = common("decode", &id, &grpc, &metrics, "24");
            a.extend(strings(&["--init-new-token-ratio", "0", "--min-new-token-ratio", "0"]));
            a.extend(strings(&["--transfer-addr", &data, "--transfer-advertise-addr", &proxy.addr().to_string()]));
            decode.push(Daemon::new(FERRY, &id, a, grpc));
            proxies.push(proxy);
            decode_metrics.push(metrics);
            decode_data.push(data);
        }
        let (router_grpc, router_metrics, router_http) = (ports.take(), ports.take(), ports.take());
        let mut ra = strings(&["router", "--model", &model, "--grpc-addr", &router_grpc, "--http-addr", &router_http]);
        ra.extend(strings(&["--page-size", "8", "--insecure-internal"]));
        // Every prompt through a prefill node and the data plane, which the faults are aimed
        // at: the load repeats a few prompts, which the decode nodes' caches would otherwise
        // soon hold, and prefill locally.
        ra.extend(strings(&["--local-prefill-max", "0"]));
        ra.extend(strings(&["--metrics-addr", &router_metrics, "--etcd", &etcd.endpoint(), "--cluster", "chaos"]));
        let router = Daemon::new(FERRY, "router", ra, router_grpc.clone());
        let mut c =
            Self { etcd, prefill, decode, proxies, router, router_grpc, router_metrics, decode_metrics, decode_data };
        // Workers load the model in parallel; the router last.
        drop(ports);
        ferry_tests::blocking(|| {
            std::thread::scope(|s| {
                for d in c.prefill.iter_mut().chain(c.decode.iter_mut()) {
                    s.spawn(|| d.start());
                }
            })
        });
        c.router.start();
        c.wait_members(&["p0", "p1"], &["d0", "d1"], Duration::from_secs(60)).await;
        c
    }

    /// The router's workers now: (healthy prefill ids, healthy decode ids), sorted; None
    /// when the router does not answer.
    pub async fn members(&self) -> Option<(Vec<String>, Vec<String>)> {
        let all = self.listed().await?;
        let (mut p, mut d) = (Vec::new(), Vec::new());
        for w in all.into_iter().filter(|w| w.healthy) {
            if w.role == pb::WorkerRole::Prefill as i32 { p.push(w.worker_id) } else { d.push(w.worker_id) }
        }
        p.sort();
        d.sort();
        Some((p, d))
    }

    /// Every worker the router lists, healthy or not.
    async fn listed(&self) -> Option<Vec<pb::WorkerInfo>> {
        let ch = tonic::transport::Endpoint::from_shared(format!("http://{}", self.router_grpc))
            .ok()?
            .connect_timeout(Duration::from_secs(1))
            .connect()
            .await
            .ok()?;
        let r = pb::router_client::RouterClient::new(ch).list_workers(pb::ListWorkersRequest {}).await.ok()?;
        Some(r.into_inner().workers)
    }

    /// Waits until the router no longer lists `id` at all (its etcd lease expired and the
    /// router removed it, index entries included); returns how long it took.
    pub async fn wait_absent(&self, id: &str, within: Duration) -> Duration {
        let t = Instant::now();
        while t.elapsed() < within {
            if self.listed().await.is_some_and(|l| l.iter().all(|w| w.worker_id != id)) {
                return t.elapsed();
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        panic!("the router still lists {id} after {within:?}");
    }

    /// The router's retries so far, by stage (prefill, decode).
    pub async fn router_retries(&self) -> [f64; 2] {
        let body = match self.router_metrics.parse() {
            Ok(a) => ferry_tests::scrape(a).await,
            Err(_) => String::new(),
        };
        let get =
            |stage: &str| ferry_tests::metric_sum(&body, "ferry_router_retries_total", &format!("stage=\"{stage}\""));
        [get("prefill"), get("decode")]
    }

    /// Streams the router has moved to another decode worker so far (0 when it does not
    /// answer).
    pub async fn router_migrations(&self) -> f64 {
        let Ok(a) = self.router_metrics.parse() else { return 0.0 };
        let body = ferry_tests::scrape(a).await;
        ferry_tests::metric_sum(&body, "ferry_router_migrations_total", "outcome=\"resumed\"")
    }

    /// The router's retries so far after worker `worker` failed at `stage` (prefill, decode).
    pub async fn router_retries_of(&self, stage: &str, worker: &str) -> f64 {
        let Ok(a) = self.router_metrics.parse() else { return 0.0 };
        let body = ferry_tests::scrape(a).await;
        let (stage, worker) = (format!("stage=\"{stage}\""), format!("worker=\"{worker}\""));
        body.lines()
            .filter(|l| l.starts_with("ferry_router_retries_total") && l.contains(&stage) && l.contains(&worker))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    }

    /// Pages the router's prefill index holds as the workers' KV events confirmed them (0
    /// when it does not answer).
    pub async fn router_index_pages(&self) -> f64 {
        let Ok(a) = self.router_metrics.parse() else { return 0.0 };
        let body = ferry_tests::scrape(a).await;
        ferry_tests::metric_sum(&body, "ferry_router_index_pages", "role=\"prefill\",state=\"confirmed\"")
    }

    /// Waits (up to `within`) until [`Self::router_index_pages`] reaches `pages`; what it read
    /// then, or None.
    pub async fn wait_index_pages(&self, pages: f64, within: Duration) -> Option<f64> {
        let t = Instant::now();
        while t.elapsed() < within {
            let now = self.router_index_pages().await;
            if now >= pages {
                return Some(now);
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        None
    }

    /// Data-plane accepts decode daemon `i` saw fail (and retried) since its last start.
    pub async fn accept_errors(&self, i: usize) -> f64 {
        let body = ferry_tests::scrape(self.decode_metrics[i].parse().expect("addr")).await;
        ferry_tests::metric_sum(&body, "ferry_transfer_connections_refused_total", "reason=\"accept_error\"")
    }

    /// Retractions decode daemon `i` made since its last start.
    pub async fn retractions(&self, i: usize) -> f64 {
        match self.decode_metrics[i].parse() {
            Ok(a) => ferry_tests::metric_sum(&ferry_tests::scrape(a).await, "ferry_decode_retractions_total", ""),
            Err(_) => 0.0,
        }
    }

    /// Waits until the router's healthy workers are exactly these; returns how long it took.
    pub async fn wait_members(&self, prefill: &[&str], decode: &[&str], within: Duration) -> Duration {
        let t = Instant::now();
        let want = (strings(prefill), strings(decode));
        let mut last = None;
        while t.elapsed() < within {
            last = self.members().await;
            if last.as_ref() == Some(&want) {
                return t.elapsed();
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        panic!("the router's workers are {last:?}, not {want:?}, after {within:?}");
    }

    /// Waits (up to 20 s) until one of `ds` holds pages or queue entries for requests, so that
    /// a fault there hits work in flight; returns which (the cache-aware router may send every
    /// request to one worker for a while, so a fixed victim could stay idle).
    pub async fn wait_busy(ds: &[Daemon]) -> Option<usize> {
        let mut clients = Vec::new();
        for d in ds {
            clients.push(pb::load_client::LoadClient::new(ferry_tests::channel(d.grpc.parse().expect("addr")).await));
        }
        let t = Instant::now();
        while t.elapsed() < Duration::from_secs(20) {
            for (i, c) in clients.iter_mut().enumerate() {
                if let Ok(r) = c.report(pb::LoadRequest {}).await {
                    let l = r.into_inner();
                    if l.free_pages + l.evictable_pages < l.total_pages || l.queue_depth.values().any(|&n| n > 0) {
                        return Some(i);
                    }
                }
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        None
    }

    /// Waits (up to `within`) until a decode daemon has a request in its transfer queue (pages
    /// allocated, KV on its way); returns whether one did.
    pub async fn wait_transfer(&self, within: Duration) -> bool {
        self.wait_transfer_at(within).await.is_some()
    }

    /// Rooms decode daemon `i`'s receiver ended as failed (any reason) since its last start.
    pub async fn receiver_failures(&self, i: usize) -> f64 {
        match self.decode_metrics[i].parse() {
            Ok(a) => ferry_tests::metric_sum(
                &ferry_tests::scrape(a).await,
                "ferry_transfer_rooms_total",
                "side=\"receiver\",outcome=\"failed\"",
            ),
            Err(_) => 0.0,
        }
    }

    /// [`Self::wait_transfer`], saying which decode daemon.
    pub async fn wait_transfer_at(&self, within: Duration) -> Option<usize> {
        let mut clients = Vec::new();
        for d in &self.decode {
            clients.push(pb::load_client::LoadClient::new(ferry_tests::channel(d.grpc.parse().expect("addr")).await));
        }
        let t = Instant::now();
        while t.elapsed() < within {
            for (i, c) in clients.iter_mut().enumerate() {
                if let Ok(r) = c.report(pb::LoadRequest {}).await
                    && r.into_inner().queue_depth.get("transfer").is_some_and(|&n| n > 0)
                {
                    return Some(i);
                }
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        None
    }

    /// Each worker's load report: (name, report).
    pub async fn loads(&self) -> Vec<(String, pb::LoadReport)> {
        let mut out = Vec::new();
        for d in self.prefill.iter().chain(&self.decode) {
            let ch = ferry_tests::channel(d.grpc.parse().expect("addr")).await;
            let r = pb::load_client::LoadClient::new(ch).report(pb::LoadRequest {}).await.expect("load report");
            out.push((d.name.clone(), r.into_inner()));
        }
        out
    }
}
