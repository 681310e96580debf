//! etcd discovery against a real etcd server the test starts: workers join, serve, leave
//! (a graceful stop deletes the key and revokes the lease at once) and expire (a SIGKILLed worker process is gone
//! after its lease TTL); a restarted router finds the current set; a router whose etcd
//! restarts resumes its watch without missing a change.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use ferry_cluster::args::EtcdArgs;
use ferry_tests::etcd::Etcd;
use ferry_tests::{TinyModel, http};

fn etcd_args(e: &Etcd, cluster: &str) -> EtcdArgs {
    EtcdArgs { endpoints: vec![e.endpoint()], cluster: cluster.into(), ..Default::default() }
}

async fn router(m: &TinyModel, e: &Etcd, cluster: &str) -> ferry_router::Running {
    router_via(m, e.endpoint(), cluster).await
}

async fn router_via(m: &TinyModel, etcd: String, cluster: &str) -> ferry_router::Running {
    let mut a = ferry_router::RouterArgs::new(m.path(), Vec::new(), Vec::new());
    a.etcd = EtcdArgs { endpoints: vec![etcd], cluster: cluster.into(), ..Default::default() };
    ferry_router::start(a).await.expect("router up")
}

async fn prefill(m: &TinyModel, e: &Etcd, cluster: &str, id: &str, ttl: i64) -> ferry_prefill::Running {
    let mut a = ferry_prefill::PrefillArgs::for_model(m.path());
    a.worker.pool_pages = 256;
    a.worker.worker_id = Some(id.parse().expect("a worker id"));
    a.worker.etcd = etcd_args(e, cluster);
    a.worker.etcd_lease_ttl = ttl;
    ferry_prefill::start(a).await.expect("prefill up")
}

async fn decode(m: &TinyModel, e: &Etcd, cluster: &str, id: &str, ttl: i64) -> ferry_decode::Running {
    let mut a = ferry_decode::DecodeArgs::for_model(m.path());
    a.worker.pool_pages = 256;
    a.worker.worker_id = Some(id.parse().expect("a worker id"));
    a.worker.etcd = etcd_args(e, cluster);
    a.worker.etcd_lease_ttl = ttl;
    ferry_decode::start(a).await.expect("decode up")
}

/// A decode daemon as its own process (`ferry decode`).
fn decode_process(m: &TinyModel, e: &Etcd, cluster: &str, id: &str, ttl: i64) -> Child {
    Command::new(env!("CARGO_BIN_EXE_ferry"))
        .arg("decode")
        .arg("--model")
        .arg(m.path())
        .args(["--pool-pages", "256", "--worker-id", id, "--etcd", &e.endpoint(), "--cluster", cluster])
        .args(["--etcd-lease-ttl", &ttl.to_string(), "--insecure-internal"])
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .spawn()
        .expect("start `ferry decode`")
}

/// The router's workers: (prefill ids, decode ids), sorted.
fn members(r: &ferry_router::Running) -> (Vec<String>, Vec<String>) {
    let s = r.workers().snapshot();
    let mut p: Vec<String> = s.prefill.iter().flatten().map(|w| w.id.to_string()).collect();
    let mut d: Vec<String> = s.decode.iter().map(|w| w.id.to_string()).collect();
    p.sort();
    d.sort();
    (p, d)
}

async fn wait_for(r: &ferry_router::Running, prefill: &[&str], decode: &[&str], within: Duration) -> Duration {
    let t = Instant::now();
    let want = (prefill.iter().map(|s| s.to_string()).collect(), decode.iter().map(|s| s.to_string()).collect());
    while t.elapsed() < within {
        if members(r) == want && r.ready(prefill.len(), decode.len()) {
            return t.elapsed();
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("after {within:?} the router has {:?}, not {want:?}", members(r));
}

async fn complete(r: &ferry_router::Running) -> u16 {
    let (_, _, body) = http(r.http_addr, "GET", "/v1/models", b"").await;
    let served = serde_json::from_str::<serde_json::Value>(&body).expect("json")["data"][0]["id"].clone();
    let req = serde_json::json!({"model": served, "prompt": "a b c d e f g h i j k l m n o p q r s t u v w x y z", "max_tokens": 4, "temperature": 0});
    http(r.http_addr, "POST", "/v1/completions", req.to_string().as_bytes()).await.0
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_join_leave_and_expire() {
    let e = Etcd::start();
    let m = TinyModel::new();
    let r = router(&m, &e, "t1").await;
    assert_eq!(members(&r), (vec![], vec![]));

    // Join: one in-process prefill daemon (lease 30 s) and one decode daemon process (2 s).
    let p = prefill(&m, &e, "t1", "p0", 30).await;
    let mut child = decode_process(&m, &e, "t1", "d0", 2);
    wait_for(&r, &["p0"], &["d0"], Duration::from_secs(60)).await;
    assert_eq!(complete(&r).await, 200);
    // KV events reach the router on their own stream: give them a moment.
    let deadline = Instant::now() + Duration::from_secs(5);
    while r.index_pages() == 0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(r.index_pages() > 0, "the prefill worker's KV events reached the index");

    // Leave: a graceful stop deletes the key and revokes the lease, so the worker is gone long before its 30 s
    // TTL, and its index entries with it.
    let t = Instant::now();
    p.stop().await;
    wait_for(&r, &[], &["d0"], Duration::from_secs(10)).await;
    let took = t.elapsed();
    println!("graceful leave seen after {took:?} (lease TTL 30 s)");
    assert_eq!(r.index_pages(), 0, "a departed worker's index entries are dropped");

    // Expiry: the decode process is killed; nothing revokes its lease, which expires.
    child.kill().expect("SIGKILL");
    let _ = child.wait();
    let took = wait_for(&r, &[], &[], Duration::from_secs(15)).await;
    println!("killed worker gone after {took:?} (lease TTL 2 s)");
    assert_eq!(complete(&r).await, 429, "no decode worker left: refused with a retry hint");
    r.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restarts_miss_no_change() {
    let mut e = Etcd::start();
    let m = TinyModel::new();

    // A router sees d0, then goes away; while it is down d0 leaves and p0, d1 join.
    let r = router(&m, &e, "t2").await;
    let d0 = decode(&m, &e, "t2", "d0", 5).await;
    wait_for(&r, &[], &["d0"], Duration::from_secs(10)).await;
    r.stop().await;
    d0.stop().await;
    let p0 = prefill(&m, &e, "t2", "p0", 5).await;
    let d1 = decode(&m, &e, "t2", "d1", 5).await;

    // A new router lists the current set, then watches from the next revision.
    let r = router(&m, &e, "t2").await;
    wait_for(&r, &["p0"], &["d1"], Duration::from_secs(10)).await;
    // Another cluster's workers are not ours.
    let other = decode(&m, &e, "other", "x0", 5).await;

    // etcd restarts under the router: its watch reconnects and p0's leaving, p1's joining
    // afterwards are seen.
    e.restart();
    p0.stop().await;
    let p1 = prefill(&m, &e, "t2", "p1", 5).await;
    wait_for(&r, &["p1"], &["d1"], Duration::from_secs(20)).await;
    assert_eq!(complete(&r).await, 200);

    for x in [d1, other] {
        x.stop().await;
    }
    p1.stop().await;
    wait_for(&r, &[], &[], Duration::from_secs(10)).await;
    r.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_off_router_resumes_its_watch_from_the_next_revision() {
    let e = Etcd::start();
    let m = TinyModel::new();
    let proxy = ferry_tests::proxy::Proxy::start(e.endpoint()).await;
    let r = router_via(&m, proxy.addr().to_string(), "t3").await;
    let d0 = decode(&m, &e, "t3", "d0", 5).await;
    let p0 = prefill(&m, &e, "t3", "p0", 5).await;
    wait_for(&r, &["p0"], &["d0"], Duration::from_secs(10)).await;

    // The router loses etcd (etcd itself stays up). Meanwhile p0 leaves and p1 joins: a watch
    // restarted from "now" would miss both; resumed from the revision after the last event
    // the router applied, it sees both.
    proxy.cut();
    tokio::time::sleep(Duration::from_millis(300)).await;
    p0.stop().await;
    let p1 = prefill(&m, &e, "t3", "p1", 5).await;
    assert_eq!(members(&r).0, ["p0"], "cut off, the router has not seen the change yet");
    proxy.restore();
    let took = wait_for(&r, &["p1"], &["d0"], Duration::from_secs(20)).await;
    println!("after the cut, the router caught up in {took:?}");
    assert_eq!(complete(&r).await, 200);
    r.stop().await;
    p1.stop().await;
    d0.stop().await;
}

/// A child process, killed when dropped (a failed assertion leaves no daemon behind).
struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// etcd closes a connection whose client pings more often than its `--grpc-keepalive-min-time`
/// (5 s by default) allows, or pings with no stream open; with 2 s pings the router's watch
/// broke and was set up again every few seconds. A router (its own process) watching an etcd
/// where nothing changes for 16 s must not have set its watch up again once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quiet_watch_is_not_cut_by_etcd() {
    let mut e = Etcd::start();
    let m = TinyModel::new();
    let metrics: std::net::SocketAddr =
        format!("127.0.0.1:{}", ferry_tests::etcd::free_port()).parse().expect("metrics address");
    let _router = Killed(
        Command::new(env!("CARGO_BIN_EXE_ferry"))
            .arg("router")
            .arg("--model")
            .arg(m.path())
            .args(["--grpc-addr", "127.0.0.1:0", "--http-addr", "127.0.0.1:0", "--metrics-addr", &metrics.to_string()])
            .args(["--etcd", &e.endpoint(), "--cluster", "t4", "--insecure-internal"])
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .spawn()
            .expect("start `ferry router`"),
    );
    let _worker = Killed(decode_process(&m, &e, "t4", "d0", 5));
    // The router's watch is up once it has seen the worker join.
    let joined = |b: &str| {
        b.lines().any(|l| {
            l.starts_with("ferry_router_workers{")
                && l.contains("role=\"decode\"")
                && l.contains("state=\"healthy\"")
                && l.ends_with(" 1")
        })
    };
    let t = Instant::now();
    loop {
        if tokio::net::TcpStream::connect(metrics).await.is_ok() && joined(&ferry_tests::scrape(metrics).await) {
            break;
        }
        assert!(t.elapsed() < Duration::from_secs(60), "the router never saw d0 join");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tokio::time::sleep(Duration::from_secs(16)).await;
    let body = ferry_tests::scrape(metrics).await;
    assert!(joined(&body), "the router still lists d0:\n{body}");
    assert_eq!(ferry_tests::metric_sum(&body, "ferry_etcd_reconnects_total", "stream=\"watch\""), 0.0, "{body}");
    // The counter is live: etcd going away and coming back sets the watch up again.
    e.kill();
    tokio::time::sleep(Duration::from_secs(1)).await;
    e.restart();
    let t = Instant::now();
    loop {
        let body = ferry_tests::scrape(metrics).await;
        if ferry_tests::metric_sum(&body, "ferry_etcd_reconnects_total", "stream=\"watch\"") >= 1.0 {
            break;
        }
        assert!(t.elapsed() < Duration::from_secs(30), "a broken watch was not counted:\n{body}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
