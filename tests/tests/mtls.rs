//! Mutual TLS between daemons: with `--internal-tls-*` on every daemon, the router reaches
//! the workers and the decode worker the prefill worker over TLS with client certificates,
//! and a request gives the colocated engine's tokens. A worker's gRPC refuses plaintext,
//! a client without a certificate and one whose certificate another CA signed; the failed
//! handshakes are counted. A certificate the CA signed for the wrong role (or for none) is
//! refused on every worker RPC (`PERMISSION_DENIED`, `wrong_role`, counted), and a worker
//! presenting the wrong role is refused by its callers (the router, a decode worker's
//! handshake). Unreadable files stop a daemon at start with a clear error.

use std::time::Duration;

#[path = "mtls/data_plane.rs"]
mod data_plane;

use ferry_proto::v1 as pb;
use ferry_tests::pki::{Leaf, PeerRole, Pki};
use ferry_tests::{TinyModel, colocated, greedy, scrape, settle};
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity};
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_client::HealthClient;

/// Whether a health check over `ep` answers SERVING.
async fn serving(ep: Endpoint) -> Result<(), String> {
    let ch = ep.connect_timeout(Duration::from_secs(2)).connect().await.map_err(|e| format!("connect: {e:?}"))?;
    let r = tokio::time::timeout(Duration::from_secs(5), HealthClient::new(ch).check(HealthCheckRequest::default()))
        .await
        .map_err(|_| "timed out".to_string())?
        .map_err(|e| format!("check: {e}"))?;
    if r.into_inner().status == 1 { Ok(()) } else { Err("not serving".into()) }
}

async fn refusals(metrics: std::net::SocketAddr) -> f64 {
    ferry_tests::metric_sum(&scrape(metrics).await, "ferry_bad_requests_total", "reason=\"mtls_handshake\"")
}

/// Waits (up to 5 s) until the refused-handshake count passes `before`: each refusal is
/// counted when the server side of its handshake ends, which may be after the client gave up
/// (and a client may have tried more than once).
async fn counted_more(metrics: std::net::SocketAddr, before: f64, what: &str) -> f64 {
    for _ in 0..100 {
        let now = refusals(metrics).await;
        if now > before {
            return now;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("the refused handshake ({what}) was not counted: still {before}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn daemons_talk_over_mutual_tls_and_refuse_strangers() {
    let m = TinyModel::new();
    let pki = Pki::new("ferry test CA");
    let names = ["localhost", "127.0.0.1"];
    let (pl, dl, rl) = (
        pki.issue("prefill", Some(PeerRole::Prefill), &names),
        pki.issue("decode", Some(PeerRole::Decode), &names),
        pki.issue("router", Some(PeerRole::Router), &names),
    );

    let (p, d) = workers(&m, pki.args(&pl), pki.args(&dl)).await;
    // A worker named with http:// while mutual TLS is on would be called in plaintext: refused
    // (at start for flags; a discovered one is refused and counted as worker_refused).
    let mut plain = ferry_router::RouterArgs::new(
        m.path(),
        vec![p.grpc_addr.to_string()],
        vec![format!("d-plain=http://{}", d.grpc_addr)],
    );
    plain.internal_tls = pki.args(&rl);
    let e = ferry_router::start(plain).await.map(|_| ()).expect_err("an http:// worker under mutual TLS");
    assert!(e.to_string().contains("plaintext"), "{e}");
    let r = router(&m, &p, &d, pki.args(&rl)).await;

    // A request through the whole cluster.
    one_request(&m, &r).await;

    // Strangers at the prefill worker's gRPC port.
    let addr = p.grpc_addr;
    let https = || Endpoint::from_shared(format!("https://{addr}")).expect("uri");
    let plain = Endpoint::from_shared(format!("http://{addr}")).expect("uri");
    let counted = refusals(p.metrics_addr).await;
    assert!(serving(plain).await.is_err(), "plaintext is refused");
    let counted = counted_more(p.metrics_addr, counted, "plaintext").await;
    let ca = Certificate::from_pem(pki.ca_pem());
    let no_cert = https().tls_config(ClientTlsConfig::new().ca_certificate(ca.clone())).expect("tls");
    assert!(serving(no_cert).await.is_err(), "a client without a certificate is refused");
    let counted = counted_more(p.metrics_addr, counted, "no client certificate").await;
    let other = Pki::new("another CA");
    let stranger = other.issue("stranger", Some(PeerRole::Router), &names);
    let wrong_ca = https()
        .tls_config(
            ClientTlsConfig::new()
                .ca_certificate(ca.clone())
                .identity(Identity::from_pem(&stranger.cert_pem, &stranger.key_pem)),
        )
        .expect("tls");
    assert!(serving(wrong_ca).await.is_err(), "a certificate from another CA is refused");
    counted_more(p.metrics_addr, counted, "another CA").await;
    let member = pki.issue("member", None, &names);
    let good = https()
        .tls_config(
            ClientTlsConfig::new().ca_certificate(ca).identity(Identity::from_pem(&member.cert_pem, &member.key_pem)),
        )
        .expect("tls");
    serving(good).await.expect("a cluster member is served");

    // Each worker RPC answers only its role: every other role, and a certificate naming none,
    // is refused before the call reaches the service; the allowed role gets past the gate.
    let callers = [(Some(PeerRole::Router), &rl), (Some(PeerRole::Prefill), &pl), (Some(PeerRole::Decode), &dl)];
    let callers: Vec<(Option<PeerRole>, &Leaf)> = callers.into_iter().chain([(None, &member)]).collect();
    // Both workers run in this process and share its metrics (labelled by role): one scrape.
    let before = wrong_role(p.metrics_addr).await;
    let mut refused = 0;
    for (caller, leaf) in &callers {
        let (pc, dc) = (as_peer(&pki, p.grpc_addr, leaf), as_peer(&pki, d.grpc_addr, leaf));
        for (rpc, allowed, got) in worker_calls(pc, dc).await {
            if *caller == Some(allowed) {
                assert!(
                    got.as_ref().err().is_none_or(|s| s.code() != tonic::Code::PermissionDenied),
                    "{rpc} refused its own role {allowed}: {got:?}"
                );
                continue;
            }
            let e = got.expect_err(&format!("{rpc} called by {caller:?}"));
            assert_eq!(e.code(), tonic::Code::PermissionDenied, "{rpc} by {caller:?}: {e}");
            assert_eq!(e.metadata().get("ferry-reason").and_then(|v| v.to_str().ok()), Some("wrong_role"));
            assert!(e.message().contains(&format!("served to the {allowed} only")), "{}", e.message());
            refused += 1;
        }
    }
    assert_eq!(refused, 10 * 3, "10 RPCs, each refused to 3 of the 4 callers");
    let after = wrong_role(p.metrics_addr).await;
    assert_eq!(after - before, refused as f64, "every wrong-role call is counted");

    // The other way round: a caller checks the role of the worker it dials. A router given the
    // decode worker as its prefill worker (and the prefill as its decode) never takes them up,
    // and a decode worker sent to bootstrap from a non-prefill address ends the request.
    let client_refusals = || async {
        ferry_tests::metric_sum(&scrape(p.metrics_addr).await, "ferry_bad_requests_total", "role=\"client\"")
    };
    // Waits (up to 5 s) until the count passes `above`: each direction's refusal on its own.
    let counted_above = |above: f64, what: &'static str| async move {
        for _ in 0..100 {
            let now = client_refusals().await;
            if now > above {
                return now;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("the refused dial ({what}) was not counted: still {above}");
    };
    // Each router has one worker in its right place (taken up: the check passes the right
    // role) and one in the wrong place (never taken up), one for each direction, one router
    // at a time so that each direction's refusal is counted on its own.
    let misplaced = |prefill: std::net::SocketAddr, decode: std::net::SocketAddr| {
        let mut a = ferry_router::RouterArgs::new(m.path(), vec![prefill.to_string()], vec![decode.to_string()]);
        a.internal_tls = pki.args(&rl);
        ferry_router::start(a)
    };
    // (healthy prefill workers, healthy decode workers) a router sees.
    let healthy = |r: &ferry_router::Running| {
        let s = r.workers().snapshot();
        (s.prefill.iter().flatten().filter(|w| w.healthy()).count(), s.decode.iter().filter(|w| w.healthy()).count())
    };
    let mut counted = client_refusals().await;
    for (prefill, decode, want, what) in [
        (d.grpc_addr, d.grpc_addr, (0, 1), "a decode worker dialled as a prefill worker"),
        (p.grpc_addr, p.grpc_addr, (1, 0), "a prefill worker dialled as a decode worker"),
    ] {
        let router = misplaced(prefill, decode).await.expect("router up");
        counted_above(counted, what).await;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while healthy(&router) != want && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        // A little longer: the misplaced worker must stay out, not only be late.
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert_eq!(healthy(&router), want, "{what}: (healthy prefill, healthy decode)");
        router.stop().await;
        counted = client_refusals().await;
    }
    let mut dc = pb::decode_client::DecodeClient::new(as_peer(&pki, d.grpc_addr, &rl));
    let req = pb::DecodeRequest {
        request_id: "bootstrap-at-a-decode-worker".into(),
        room: Some(ferry_cluster::wire::room_key_to_proto(&ferry_cluster::RoomKey::random())),
        prefill_bootstrap_addr: d.grpc_addr.to_string(),
        token_ids: (0..40).collect(),
        sampling: Some(ferry_cluster::wire::sampling_to_proto(&greedy(3))),
    };
    let ended = async {
        let mut s = dc.generate(req).await?.into_inner();
        while s.message().await?.is_some() {}
        Ok::<_, tonic::Status>(())
    };
    let e = tokio::time::timeout(Duration::from_secs(20), ended).await.expect("ends").expect_err("refused");
    assert!(e.message().contains("is not a prefill worker"), "{e}");
    counted_above(counted, "a decode worker bootstrapping from a decode worker").await;

    settle(&p, std::slice::from_ref(&d)).await;
    r.stop().await;
    d.stop().await;
    p.stop().await;
}

/// A prefill and a decode worker with these mutual TLS flags.
async fn workers(
    m: &TinyModel,
    p_tls: ferry_cluster::mtls::InternalTlsArgs,
    d_tls: ferry_cluster::mtls::InternalTlsArgs,
) -> (ferry_prefill::Running, ferry_decode::Running) {
    let mut a = ferry_prefill::PrefillArgs::for_model(m.path());
    a.worker.pool_pages = 512;
    a.worker.internal_tls = p_tls;
    let p = ferry_prefill::start(a).await.expect("prefill up");
    let mut a = ferry_decode::DecodeArgs::for_model(m.path());
    a.worker.pool_pages = 512;
    a.worker.internal_tls = d_tls;
    let d = ferry_decode::start(a).await.expect("decode up");
    (p, d)
}

/// A router over `p` and `d` with these mutual TLS flags, once it reaches both.
async fn router(
    m: &TinyModel,
    p: &ferry_prefill::Running,
    d: &ferry_decode::Running,
    tls: ferry_cluster::mtls::InternalTlsArgs,
) -> ferry_router::Running {
    let mut ra = ferry_router::RouterArgs::new(m.path(), vec![p.grpc_addr.to_string()], vec![d.grpc_addr.to_string()]);
    ra.internal_tls = tls;
    let r = ferry_router::start(ra).await.expect("router up");
    for _ in 0..500 {
        if r.ready(1, 1) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(r.ready(1, 1), "the router reaches both workers over mutual TLS");
    r
}

/// A request through the router gives the colocated engine's tokens.
async fn one_request(m: &TinyModel, r: &ferry_router::Running) {
    let prompt: Vec<u32> = (0..70).map(|i| (i * 13 % 300) as u32).collect();
    let want = colocated(&m.path(), std::slice::from_ref(&prompt), &greedy(5));
    let mut client = pb::router_client::RouterClient::new(ferry_tests::channel(r.grpc_addr).await);
    let req = pb::GenerateRequest {
        prompt: Some(pb::generate_request::Prompt::TokenIds(pb::TokenIds { ids: prompt })),
        sampling: Some(ferry_cluster::wire::sampling_to_proto(&greedy(5))),
        return_token_ids: true,
        ..Default::default()
    };
    let mut s = client.generate(req).await.expect("accepted").into_inner();
    let mut got = Vec::new();
    while let Some(m) = s.message().await.expect("a message") {
        got.extend(m.token_ids);
    }
    assert_eq!(got, want[0]);
}

/// The systemd units' PKI (`deploy/systemd/make-certs.sh`, openssl: EC keys, the role in the
/// common name, `ferry.internal` as the DNS name) runs a cluster: every daemon accepts the
/// others' certificates and roles, checked against the shared server name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_units_certificates_run_a_cluster() {
    let m = TinyModel::new();
    let dir = tempfile::tempdir().expect("tempdir");
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../deploy/systemd/make-certs.sh");
    let out = std::process::Command::new(script).arg(dir.path()).output().expect("run make-certs.sh");
    assert!(out.status.success(), "make-certs.sh: {}", String::from_utf8_lossy(&out.stderr));
    let tls = |role: &str| ferry_cluster::mtls::InternalTlsArgs {
        internal_tls_cert: Some(dir.path().join(format!("{role}.pem"))),
        internal_tls_key: Some(dir.path().join(format!("{role}.key"))),
        internal_tls_ca: Some(dir.path().join("ca.pem")),
        internal_tls_server_name: Some("ferry.internal".into()),
        insecure_internal: false,
    };
    let (p, d) = workers(&m, tls("prefill"), tls("decode")).await;
    let r = router(&m, &p, &d, tls("router")).await;
    one_request(&m, &r).await;
    settle(&p, std::slice::from_ref(&d)).await;
    r.stop().await;
    d.stop().await;
    p.stop().await;
}

#[tokio::test]
async fn a_daemon_without_tls_flags_or_insecure_internal_does_not_start() {
    let m = TinyModel::new();
    let mut a = ferry_prefill::PrefillArgs::for_model(m.path());
    a.worker.pool_pages = 64;
    a.worker.internal_tls = Default::default();
    let e = ferry_prefill::start(a).await.map(|_| ()).expect_err("refused");
    assert!(e.to_string().contains("--insecure-internal"), "{e}");
}

async fn wrong_role(metrics: std::net::SocketAddr) -> f64 {
    ferry_tests::metric_sum(&scrape(metrics).await, "ferry_bad_requests_total", "reason=\"wrong_role\"")
}

/// A channel to `addr` presenting `leaf`.
fn as_peer(pki: &Pki, addr: std::net::SocketAddr, leaf: &Leaf) -> tonic::transport::Channel {
    Endpoint::from_shared(format!("https://{addr}"))
        .expect("uri")
        .tls_config(
            ClientTlsConfig::new()
                .ca_certificate(Certificate::from_pem(pki.ca_pem()))
                .identity(Identity::from_pem(&leaf.cert_pem, &leaf.key_pem)),
        )
        .expect("tls")
        .connect_lazy()
}

/// Every worker RPC once (empty requests): its name, the role it is for, and its result.
async fn worker_calls(
    prefill: tonic::transport::Channel,
    decode: tonic::transport::Channel,
) -> Vec<(&'static str, PeerRole, Result<(), tonic::Status>)> {
    use PeerRole::{Decode, Prefill, Router};
    fn ok<T>(r: Result<T, tonic::Status>) -> Result<(), tonic::Status> {
        r.map(|_| ())
    }
    let mut p = pb::prefill_client::PrefillClient::new(prefill.clone());
    let mut b = pb::bootstrap_client::BootstrapClient::new(prefill.clone());
    let mut k = pb::kv_events_client::KvEventsClient::new(prefill.clone());
    let mut pl = pb::load_client::LoadClient::new(prefill);
    let mut d = pb::decode_client::DecodeClient::new(decode.clone());
    let mut dk = pb::kv_events_client::KvEventsClient::new(decode.clone());
    let mut dh = pb::holder_client::HolderClient::new(decode.clone());
    let mut dl = pb::load_client::LoadClient::new(decode);
    vec![
        ("Prefill.Prefill", Router, ok(p.prefill(pb::PrefillRequest::default()).await)),
        ("Prefill.Abort", Router, ok(p.abort(pb::AbortRequest::default()).await)),
        ("Bootstrap.Handshake", Decode, ok(b.handshake(pb::HandshakeRequest::default()).await)),
        ("KvEvents.Subscribe", Router, ok(k.subscribe(pb::SubscribeRequest::default()).await)),
        ("Load.Report (prefill)", Router, ok(pl.report(pb::LoadRequest::default()).await)),
        ("Decode.Generate", Router, ok(d.generate(pb::DecodeRequest::default()).await)),
        ("Decode.Abort", Router, ok(d.abort(pb::AbortRequest::default()).await)),
        ("KvEvents.Subscribe (decode)", Router, ok(dk.subscribe(pb::SubscribeRequest::default()).await)),
        ("Load.Report (decode)", Router, ok(dl.report(pb::LoadRequest::default()).await)),
        ("Holder.Pull", Prefill, ok(dh.pull(pb::PullRequest::default()).await)),
    ]
}

#[tokio::test]
async fn unreadable_tls_files_stop_a_daemon_with_a_clear_error() {
    let m = TinyModel::new();
    let pki = Pki::new("ferry test CA");
    let leaf = pki.issue("w", Some(PeerRole::Prefill), &["localhost"]);
    let mut a = ferry_prefill::PrefillArgs::for_model(m.path());
    a.worker.pool_pages = 64;
    a.worker.internal_tls = pki.args(&leaf);
    a.worker.internal_tls.internal_tls_ca = Some("/nonexistent/ca.pem".into());
    let e = ferry_prefill::start(a.clone()).await.expect_err("refused");
    assert!(e.to_string().contains("/nonexistent/ca.pem"), "{e}");
    a.worker.internal_tls = pki.args(&leaf);
    a.worker.internal_tls.internal_tls_key = Some(leaf.cert.clone());
    let e = ferry_prefill::start(a).await.expect_err("refused");
    assert!(e.to_string().contains("--internal-tls-key"), "{e}");
}
