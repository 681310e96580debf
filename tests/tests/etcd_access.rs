//! TLS and authentication towards a real etcd: workers register and a router discovers them
//! over TLS with client certificates (`--etcd-ca/-cert/-key`), and as an etcd user
//! (`--etcd-user`, `--etcd-password-file`) once etcd's authentication is on. A daemon that
//! cannot pass (no CA, no client certificate, no or a wrong password, an `http://` endpoint
//! with TLS on) does not start, and says why. A router under mutual TLS refuses a worker
//! entry that would downgrade it (`http://`), counted.

use std::path::Path;
use std::time::Duration;

use ferry_cluster::args::EtcdArgs;
use ferry_tests::TinyModel;
use ferry_tests::etcd::{Etcd, ServerTls};
use ferry_tests::pki::Pki;

async fn prefill(m: &TinyModel, etcd: EtcdArgs) -> Result<ferry_prefill::Running, String> {
    let mut a = ferry_prefill::PrefillArgs::for_model(m.path());
    a.worker.pool_pages = 64;
    a.worker.worker_id = Some("p0".parse().expect("a worker id"));
    a.worker.etcd = etcd;
    a.worker.etcd_lease_ttl = 2;
    ferry_prefill::start(a).await.map_err(|e| e.to_string())
}

/// A router on `etcd` sees the one prefill worker registered there.
async fn router_finds_it(m: &TinyModel, etcd: EtcdArgs) {
    let mut a = ferry_router::RouterArgs::new(m.path(), Vec::new(), Vec::new());
    a.etcd = etcd;
    let r = ferry_router::start(a).await.expect("router up");
    for _ in 0..300 {
        if r.ready(1, 0) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(r.ready(1, 0), "the router found the worker through etcd");
    r.stop().await;
}

fn args(etcd: &Etcd, cluster: &str) -> EtcdArgs {
    EtcdArgs { endpoints: vec![etcd.endpoint()], cluster: cluster.into(), ..Default::default() }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn discovery_over_tls_with_client_certificates() {
    let m = TinyModel::new();
    let pki = Pki::new("etcd test CA");
    let names = ["127.0.0.1", "localhost"];
    let server = pki.issue("etcd", None, &names);
    let client = pki.issue("ferry-etcd-client", None, &names);
    let etcd = Etcd::start_with(
        Some(ServerTls { cert: server.cert.clone(), key: server.key.clone(), client_ca: Some(pki.ca()) }),
        &[],
    );
    let tls = EtcdArgs {
        etcd_ca: Some(pki.ca()),
        etcd_cert: Some(client.cert.clone()),
        etcd_key: Some(client.key.clone()),
        ..args(&etcd, "tls")
    };

    // Refused: plaintext to a TLS etcd; TLS without the client certificate it requires; an
    // http:// endpoint while TLS is on (a downgrade).
    let e = prefill(&m, args(&etcd, "tls")).await.map(|_| ()).expect_err("plaintext to a TLS etcd");
    assert!(e.contains("etcd closed the connection (if it serves TLS, give --etcd-ca)"), "{e}");
    let e = prefill(&m, EtcdArgs { etcd_cert: None, etcd_key: None, ..tls.clone() })
        .await
        .map(|_| ())
        .expect_err("no client certificate");
    assert!(e.contains("etcd wants a client certificate and none was given (--etcd-cert, --etcd-key)"), "{e}");
    let downgrade = EtcdArgs { endpoints: vec![format!("http://{}", etcd.endpoint())], ..tls.clone() };
    let e = prefill(&m, downgrade).await.map(|_| ()).expect_err("http:// with --etcd-ca");
    assert!(e.contains("does not match TLS to etcd"), "{e}");

    let p = prefill(&m, tls.clone()).await.expect("registers over TLS");
    router_finds_it(&m, tls).await;
    p.stop().await;
}

/// Turns on etcd's authentication with `root` and a `ferry` user that may read and write
/// `/ferry/` only.
async fn enable_auth(endpoint: &str, password: &str) {
    use etcd_client::{Client, Permission};
    let mut c = Client::connect([endpoint], None).await.expect("etcd client");
    c.user_add("root", "root-password", None).await.expect("root user");
    c.role_add("root").await.expect("root role");
    c.user_grant_role("root", "root").await.expect("root is root");
    c.role_add("ferry").await.expect("ferry role");
    c.role_grant_permission("ferry", Permission::read_write("/ferry/").with_prefix()).await.expect("permission");
    c.user_add("ferry", password, None).await.expect("ferry user");
    c.user_grant_role("ferry", "ferry").await.expect("ferry role granted");
    c.auth_enable().await.expect("auth on");
}

fn password_file(dir: &Path, name: &str, password: &str) -> std::path::PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, format!("{password}\n")).expect("password file");
    p
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn discovery_as_an_etcd_user() {
    let m = TinyModel::new();
    let etcd = Etcd::start();
    enable_auth(&etcd.endpoint(), "ferry-password").await;
    let dir = tempfile::tempdir().expect("dir");
    let user =
        |file| EtcdArgs { etcd_user: Some("ferry".into()), etcd_password_file: Some(file), ..args(&etcd, "auth") };

    let e = prefill(&m, args(&etcd, "auth")).await.map(|_| ()).expect_err("no user");
    assert!(e.contains("no user was given (--etcd-user") && e.contains("user name is empty"), "{e}");
    let e =
        prefill(&m, user(password_file(dir.path(), "wrong", "not-it"))).await.map(|_| ()).expect_err("wrong password");
    assert!(e.contains("etcd refused the user name or password") && e.contains("invalid user ID or password"), "{e}");

    let good = user(password_file(dir.path(), "good", "ferry-password"));
    let p = prefill(&m, good.clone()).await.expect("registers as the ferry user");
    router_finds_it(&m, good).await;
    p.stop().await;
}

/// One etcd key can no longer make the router call a worker in plaintext: under mutual TLS an
/// entry with `http://` is not taken up, and is counted (`worker_refused`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http_worker_entry_cannot_downgrade_mutual_tls() {
    let m = TinyModel::new();
    let etcd = Etcd::start();
    let pki = Pki::new("internal CA");
    let leaf = pki.issue("router", Some(ferry_tests::pki::PeerRole::Router), &["127.0.0.1"]);
    let mut a = ferry_router::RouterArgs::new(m.path(), Vec::new(), Vec::new());
    a.etcd = args(&etcd, "downgrade");
    a.internal_tls = pki.args(&leaf);
    let r = ferry_router::start(a).await.expect("router up");
    let refused = || async {
        ferry_tests::metric_sum(
            &ferry_tests::scrape(r.metrics_addr).await,
            "ferry_bad_requests_total",
            "worker_refused",
        )
    };
    let before = refused().await;
    let mut c = etcd_client::Client::connect([etcd.endpoint()], None).await.expect("etcd client");
    c.put("/ferry/downgrade/prefill/p-plain", r#"{"addr":"http://127.0.0.1:7001"}"#, None).await.expect("put");
    for _ in 0..250 {
        if refused().await > before {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(refused().await > before, "the entry was refused and counted");
    assert!(r.workers().snapshot().prefill.iter().flatten().next().is_none(), "and not taken up");
    r.stop().await;
}

/// A worker logged in as an etcd user leaves at once when it stops, also after its auth token
/// expired. It used to stay listed until its lease expired: etcd-client sends Lease calls
/// without the token, so etcd refused the revoke ("user name is empty"). The worker now
/// deletes its key first (renewing the token once if needed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_etcd_user_leaves_at_once_when_it_stops() {
    let m = TinyModel::new();
    let etcd = Etcd::start_with(None, &["--auth-token-ttl", "1"]);
    enable_auth(&etcd.endpoint(), "ferry-password").await;
    let dir = tempfile::tempdir().expect("dir");
    let user = EtcdArgs {
        etcd_user: Some("ferry".into()),
        etcd_password_file: Some(password_file(dir.path(), "pw", "ferry-password")),
        ..args(&etcd, "ttl")
    };
    let mut a = ferry_prefill::PrefillArgs::for_model(m.path());
    a.worker.pool_pages = 64;
    a.worker.worker_id = Some("p0".parse().expect("a worker id"));
    a.worker.etcd = user;
    a.worker.etcd_lease_ttl = 30;
    let p = ferry_prefill::start(a).await.expect("registers");
    let opts = etcd_client::ConnectOptions::new().with_user("root", "root-password");
    let mut root = etcd_client::Client::connect([etcd.endpoint()], Some(opts)).await.expect("root");
    let listed = |r: etcd_client::GetResponse| r.kvs().len();
    let get = etcd_client::GetOptions::new().with_prefix();
    assert_eq!(listed(root.get("/ferry/ttl/", Some(get.clone())).await.expect("get")), 1);
    // Well past the token's 1 s (etcd checks simple tokens' expiry every second or so).
    tokio::time::sleep(Duration::from_secs(4)).await;
    p.stop().await;
    root.refresh_token().await.expect("root logs in again");
    assert_eq!(
        listed(root.get("/ferry/ttl/", Some(get)).await.expect("get")),
        0,
        "the worker left at once, not after its 30 s lease"
    );
}
