//! Requests aborted in every queue state — client cancel, decode daemon stopped, prefill
//! daemon stopped, handshake never arriving, transfer stalled — leave the survivor with all
//! its pages back within its timeout, and the client with the reason.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use ferry_cluster::RoomKey;
use ferry_decode::DecodeArgs;
use ferry_prefill::PrefillArgs;
use ferry_proto::v1 as pb;
use ferry_tests::{Client, Failure, TinyModel, channel, greedy, metric_sum, scrape, settle, settle_decode, until};
use ferry_transfer::memory::HostPages;
use ferry_transfer::runs::coalesce;
use ferry_transfer::tcp::{TcpConfig, TcpSender};
use tonic::Code;

fn args(m: &TinyModel) -> (PrefillArgs, DecodeArgs) {
    let mut p = PrefillArgs::for_model(m.path());
    p.worker.pool_pages = 1024;
    p.worker.chunked_prefill_size = 16;
    let mut d = DecodeArgs::for_model(m.path());
    d.worker.pool_pages = 1024;
    for w in [&mut p.worker, &mut d.worker] {
        w.bootstrap_timeout = 2.0;
        w.waiting_timeout = 2.0;
        w.transfer_timeout = 1.0;
    }
    (p, d)
}

fn prompt(n: usize) -> Vec<u32> {
    (0..n).map(|i| ((i * 31 + 7) % 350) as u32).collect()
}

/// A direct Decode.Generate call (no router) prefilled by the node at `bootstrap`.
fn direct(bootstrap: impl ToString, tokens: usize) -> pb::DecodeRequest {
    pb::DecodeRequest {
        request_id: "direct".into(),
        room: Some(ferry_cluster::wire::room_key_to_proto(&RoomKey::random())),
        prefill_bootstrap_addr: bootstrap.to_string(),
        token_ids: prompt(tokens),
        sampling: None,
    }
}

fn stage(d: &ferry_decode::Running, s: &str) -> usize {
    d.load().depth.iter().find(|x| x.0 == s).map_or(0, |x| x.1)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_cancel_in_prealloc_transfer_and_running_frees_everything() {
    let m = TinyModel::new();
    let (mut pa, mut da) = args(&m);
    da.worker.pool_pages = 120;
    da.decode_admission = ferry_decode::AdmissionKind::Reserved;
    da.num_reserved_decode_tokens = 1500;
    pa.worker.chunked_prefill_size = 8;
    let p = ferry_prefill::start(pa).await.expect("prefill up");
    let d = ferry_decode::start(da).await.expect("decode up");
    let c = Client::new(d.grpc_addr, Some(p.grpc_addr)).await;
    // Running: a long generation, cancelled after its first tokens.
    let long = greedy(1500);
    let running = tokio::spawn({
        let c = c.clone();
        async move { c.generate(&prompt(300), &long).await }
    });
    until("the first request running", || stage(&d, "running") == 1).await;
    // Prealloc: the same again does not fit beside it (19 + 94 reserved pages each of 120).
    let queued = tokio::spawn({
        let c = c.clone();
        let long = greedy(1500);
        async move { c.generate(&prompt(300), &long).await }
    });
    until("the second request waiting for pages", || stage(&d, "prealloc") == 1).await;
    queued.abort();
    until("the queued request gone", || stage(&d, "prealloc") == 0).await;
    running.abort();
    settle(&p, std::slice::from_ref(&d)).await;
    // Transfer: a long prompt computed 8 tokens a pass, cancelled while its pages arrive.
    let slow = tokio::spawn({
        let c = c.clone();
        async move { c.generate(&prompt(600), &greedy(4)).await }
    });
    until("a transfer in progress", || stage(&d, "transfer") == 1 && p.load().depth.1 == 1).await;
    slow.abort();
    settle(&p, std::slice::from_ref(&d)).await;
    p.stop().await;
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_decode_daemon_leaves_the_prefill_daemon_clean() {
    let m = TinyModel::new();
    let (pa, da) = args(&m);
    let p = ferry_prefill::start(pa).await.expect("prefill up");
    let d = ferry_decode::start(da).await.expect("decode up");
    let key = RoomKey::random();
    let decode_call = pb::DecodeRequest {
        request_id: "x".into(),
        room: Some(ferry_cluster::wire::room_key_to_proto(&key)),
        prefill_bootstrap_addr: p.grpc_addr.to_string(),
        token_ids: prompt(1800),
        sampling: None,
    };
    let mut decode = pb::decode_client::DecodeClient::new(channel(d.grpc_addr).await);
    let _stream = decode.generate(decode_call).await.expect("accepted");
    let mut prefill = pb::prefill_client::PrefillClient::new(channel(p.grpc_addr).await);
    let prefill_call = pb::PrefillRequest {
        request_id: "x".into(),
        room: Some(ferry_cluster::wire::room_key_to_proto(&key)),
        token_ids: prompt(1800),
        sampling: None,
        priority: 0,
        pull_from: String::new(),
    };
    let r = tokio::spawn(async move { prefill.prefill(prefill_call).await });
    until("prefill computing the room", || p.load().depth.1 == 1).await;
    d.stop().await;
    let e = r.await.expect("join").expect_err("the transfer cannot finish");
    assert_eq!(e.code(), Code::Unavailable, "{e:?}");
    assert!(e.message().contains("transfer failed"), "{}", e.message());
    settle(&p, &[]).await;
    p.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_prefill_daemon_leaves_the_decode_daemon_clean() {
    let m = TinyModel::new();
    let (pa, da) = args(&m);
    let p = ferry_prefill::start(pa).await.expect("prefill up");
    let d = ferry_decode::start(da).await.expect("decode up");
    let c = Client::new(d.grpc_addr, Some(p.grpc_addr)).await;
    let r = tokio::spawn(async move { c.generate(&prompt(1800), &greedy(4)).await });
    until("the room transferring", || stage(&d, "transfer") == 1 && p.load().depth.1 == 1).await;
    p.stop().await;
    match r.await.expect("join") {
        Err(Failure::Decode(s)) => assert!(s.message().contains("KV transfer failed"), "{s:?}"),
        other => panic!("expected the decode stream to fail with the transfer's reason: {other:?}"),
    }
    until("decode pages back", || d.load().free_pages == d.load().total_pages).await;
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_prefill_node_fails_the_handshake_and_frees_the_room() {
    let m = TinyModel::new();
    let (_, da) = args(&m);
    let d = ferry_decode::start(da).await.expect("decode up");
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        l.local_addr().expect("addr")
    };
    let c = Client::new(d.grpc_addr, None).await;
    let mut decode = pb::decode_client::DecodeClient::new(channel(d.grpc_addr).await);
    let req = direct(dead, 50);
    let mut s = decode.generate(req).await.expect("accepted").into_inner();
    let e = s.message().await.expect_err("the handshake fails");
    assert_eq!(e.code(), Code::Unavailable, "{e:?}");
    assert!(e.message().contains("prefill node"), "{}", e.message());
    until("decode pages back", || d.load().free_pages == d.load().total_pages).await;
    drop(c);
    d.stop().await;
}

/// Whether a socket of this machine is connecting to port `port` of 127.0.0.1 (SYN sent, no
/// answer yet), from the kernel's table of TCP sockets.
fn connecting_to(port: u16) -> bool {
    let table = std::fs::read_to_string("/proc/net/tcp").expect("/proc/net/tcp");
    let remote = format!("0100007F:{port:04X}");
    // Columns: sl, local address, remote address, state (02: SYN_SENT), ...
    table.lines().skip(1).any(|l| {
        let cols: Vec<&str> = l.split_whitespace().collect();
        cols.get(2) == Some(&remote.as_str()) && cols.get(3) == Some(&"02")
    })
}

/// Issue 21's defect 4 on the decode side: a prefill address whose connects hang (a
/// listener with a full accept queue drops SYNs; a black-holed host looks the same) used to
/// hold the node's channel lock across the connect, so every other handshake waited for it.
/// Ordered by events, not clocks: another request is served from start to end while the
/// decode node's connect to the black hole is in flight (its SYN unanswered before and after),
/// and the stuck request is still waiting when it is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_address_that_never_answers_delays_only_its_own_handshakes() {
    let m = TinyModel::new();
    let (pa, mut da) = args(&m);
    da.worker.bootstrap_timeout = 5.0;
    let p = ferry_prefill::start(pa).await.expect("prefill up");
    let d = ferry_decode::start(da).await.expect("decode up");
    let hole = tokio::net::TcpSocket::new_v4().expect("socket");
    hole.bind("127.0.0.1:0".parse().expect("addr")).expect("bind");
    let hole = hole.listen(0).expect("listen");
    let hole_addr = hole.local_addr().expect("addr");
    let _filler = std::net::TcpStream::connect(hole_addr).expect("fill the accept queue");
    let mut decode = pb::decode_client::DecodeClient::new(channel(d.grpc_addr).await);
    let req = direct(hole_addr, 50);
    let stuck = tokio::spawn(async move {
        let t = std::time::Instant::now();
        let mut s = decode.generate(req).await.expect("accepted").into_inner();
        (s.message().await.map(|_| ()), t.elapsed())
    });
    until("the decode node's connect to the black hole", || connecting_to(hole_addr.port())).await;
    let c = Client::new(d.grpc_addr, Some(p.grpc_addr)).await;
    c.generate(&prompt(40), &greedy(4)).await.expect("served");
    assert!(connecting_to(hole_addr.port()), "served only once the stuck connect had ended");
    assert!(!stuck.is_finished(), "served only once the stuck request had ended");
    let (r, took) = stuck.await.expect("task");
    let e = r.expect_err("the handshake to the black hole fails");
    assert!(matches!(e.code(), Code::DeadlineExceeded | Code::Unavailable), "{e:?}");
    // Its room's waiting timeout (2 s) or the handshake timeout (5 s) ends it.
    assert!(took < Duration::from_secs(7), "ended after {took:?}");
    until("decode pages back", || d.load().free_pages == d.load().total_pages).await;
    d.stop().await;
    p.stop().await;
}

/// A stand-in prefill node: accepts handshakes, then sends `pages` of the room's pages (0:
/// none) and stalls.
struct Stalling {
    pages: usize,
    /// Then send half of one more page's frame and stall mid-frame.
    mid_frame: bool,
}

#[tonic::async_trait]
impl pb::bootstrap_server::Bootstrap for Stalling {
    async fn handshake(
        &self,
        req: tonic::Request<pb::HandshakeRequest>,
    ) -> Result<tonic::Response<pb::HandshakeResponse>, tonic::Status> {
        let r = req.into_inner();
        let key = ferry_cluster::wire::room_key(r.room).expect("room");
        let secret = key.secret;
        let page_bytes = {
            let l = r.layout.expect("layout");
            (l.num_layers * 2 * l.page_size * l.num_kv_heads * l.head_dim * 4) as usize
        };
        let (n, mid_frame) = (self.pages, self.mid_frame);
        tokio::spawn(async move {
            let addr: SocketAddr = r.data_endpoint.parse().expect("tcp endpoint");
            let mut raw = None;
            let mut tx = None;
            if n > 0 {
                let mem = Arc::new(HostPages::new(page_bytes, n).expect("pages"));
                let t = TcpSender::connect(addr, TcpConfig::default()).await.expect("connect");
                let src: Vec<u32> = (0..n as u32).collect();
                t.send_pages(key.room, secret, &coalesce(&src, &r.dest_pages[..n]), &mem).await.expect("send");
                tx = Some(t);
            }
            if mid_frame {
                use tokio::io::AsyncWriteExt;
                let payload = vec![0u8; page_bytes];
                let h = ferry_transfer::frame::Header::pages(key.room, secret, r.dest_pages[n], 1, &payload);
                let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
                s.write_all(&h.encode()).await.expect("header");
                s.write_all(&payload[..page_bytes / 2]).await.expect("half the payload");
                raw = Some(s);
            }
            // Stall with the connections open.
            tokio::time::sleep(Duration::from_secs(30)).await;
            drop((tx, raw));
        });
        Ok(tonic::Response::new(pb::HandshakeResponse { room: key.room.get() }))
    }
}

async fn stalling_prefill(pages: usize, mid_frame: bool) -> SocketAddr {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = l.local_addr().expect("addr");
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(pb::bootstrap_server::BootstrapServer::new(Stalling { pages, mid_frame }))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(l)),
    );
    addr
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_transfers_time_out_and_free_the_room() {
    let m = TinyModel::new();
    let (_, da) = args(&m);
    let d = ferry_decode::start(da).await.expect("decode up");
    // Stalled before any page, after two, and mid-frame (a run claimed, its payload never
    // finishing: the receiver drops the connection after the transfer timeout without a byte,
    // so the claimed pages come back too).
    for (pages, mid_frame, state) in
        [(0, false, "WaitingForInput"), (2, false, "Transferring"), (1, true, "Transferring")]
    {
        let prefill = stalling_prefill(pages, mid_frame).await;
        let mut decode = pb::decode_client::DecodeClient::new(channel(d.grpc_addr).await);
        let req = direct(prefill, 100);
        let mut s = decode.generate(req).await.expect("accepted").into_inner();
        let e = s.message().await.expect_err("the room times out");
        assert!(matches!(e.code(), Code::DeadlineExceeded | Code::Unavailable), "{e:?}");
        assert!(e.message().contains(state) || e.message().contains("stalled"), "{state}: {}", e.message());
        until("decode pages back", || d.load().free_pages == d.load().total_pages).await;
    }
    d.stop().await;
}

/// A transfer that found a cached prefix (delta transfer) and is cancelled mid-write: the
/// prefix it read stays locked until the last write lands, so the queues' pages and the pool
/// agree throughout and everything comes back. Before, the cancel unlocked the prefix at once
/// while the queues counted it among the room's draining pages: the engine's page check
/// failed whenever a client went away with a write in flight (a rare CI failure of the test
/// above, its transfer cancel).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transfer_cancelled_mid_write_keeps_its_cached_prefix_until_released() {
    let m = TinyModel::new();
    let (_, da) = args(&m);
    let d = ferry_decode::start(da).await.expect("decode up");
    let mut decode = pb::decode_client::DecodeClient::new(channel(d.grpc_addr).await);
    // The cache holds prompt(100)'s 6 whole pages: prefilled here, finished.
    let mut local = direct("", 100);
    local.sampling = Some(ferry_cluster::wire::sampling_to_proto(&greedy(2)));
    let mut s = decode.generate(local).await.expect("accepted").into_inner();
    while s.message().await.expect("stream").is_some() {}
    // prompt(200) starts with it: its room reads those pages, a stalled sender writes the rest.
    let prefill = stalling_prefill(0, true).await;
    let s = decode.generate(direct(prefill, 200)).await.expect("accepted").into_inner();
    until("the run claimed", || stage(&d, "transfer") == 1).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    drop(s);
    until("the request gone", || stage(&d, "transfer") == 0).await;
    // Released after the transfer timeout (1 s) drops the stalled connection.
    settle_decode(std::slice::from_ref(&d)).await;
    let mut again = direct("", 100);
    again.sampling = Some(ferry_cluster::wire::sampling_to_proto(&greedy(2)));
    let mut s = decode.generate(again).await.expect("the daemon still serves").into_inner();
    let first = s.message().await.expect("stream").expect("a token");
    assert_eq!(first.cached_tokens, 96, "the prefix is still cached");
    while s.message().await.expect("stream").is_some() {}
    settle_decode(std::slice::from_ref(&d)).await;
    d.stop().await;
}

/// A graceful stop is bounded even when a sender stalls mid-frame into the node: the stalled
/// read ends after the transfer timeout (1 s here), the room's pages come back, and the
/// daemon stops. Before the receiver's progress timeout, the claimed pages were never
/// released and the stop waited for them forever; the daemon's own backstop (2 × the transfer
/// timeout + 5 s: 7 s here) now ends even that, which this test would also report.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_graceful_stop_is_bounded_with_a_sender_stalled_mid_frame() {
    let m = TinyModel::new();
    let (_, da) = args(&m);
    let d = ferry_decode::start(da).await.expect("decode up");
    let prefill = stalling_prefill(0, true).await;
    let mut decode = pb::decode_client::DecodeClient::new(channel(d.grpc_addr).await);
    let req = direct(prefill, 100);
    let _s = decode.generate(req).await.expect("accepted").into_inner();
    until("the run claimed", || stage(&d, "transfer") == 1).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let t = std::time::Instant::now();
    // In a task of its own: a stop that blocks its thread must not block the timeout.
    let stop = tokio::spawn(async move { d.stop().await });
    tokio::time::timeout(Duration::from_secs(10), stop).await.expect("the stop ends within 10 s").expect("stop");
    assert!(t.elapsed() < Duration::from_secs(5), "stopped in {:?}; the transfer timeout is 1 s", t.elapsed());
}

/// Engine wake-ups of the worker `id` so far.
async fn wakeups(metrics: SocketAddr, id: &ferry_cluster::WorkerId) -> f64 {
    metric_sum(&scrape(metrics).await, "ferry_engine_wakeups_total", &format!("worker=\"{id}\""))
}

/// Issue 21's "no polling": an engine with nothing to compute sleeps until a command or its
/// next deadline. The decode engine used to wake every millisecond while a room's pages were
/// in transfer (~1,000 wake-ups a second), the prefill engine every 20 ms when idle.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engines_waiting_for_a_transfer_or_idle_do_not_poll() {
    let m = TinyModel::new();
    let (pa, mut da) = args(&m);
    da.worker.transfer_timeout = 10.0;
    da.worker.bootstrap_timeout = 10.0;
    let p = ferry_prefill::start(pa).await.expect("prefill up");
    let d = ferry_decode::start(da).await.expect("decode up");
    let c = Client::new(d.grpc_addr, Some(p.grpc_addr)).await;
    c.generate(&prompt(40), &greedy(4)).await.expect("served");
    let prefill = stalling_prefill(2, false).await;
    let mut decode = pb::decode_client::DecodeClient::new(channel(d.grpc_addr).await);
    let mut s = decode.generate(direct(prefill, 100)).await.expect("accepted").into_inner();
    until("the room transferring", || stage(&d, "transfer") == 1).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let (d0, p0) = (wakeups(d.metrics_addr, &d.worker_id).await, wakeups(p.metrics_addr, &p.worker_id).await);
    tokio::time::sleep(Duration::from_secs(1)).await;
    let (d1, p1) = (wakeups(d.metrics_addr, &d.worker_id).await, wakeups(p.metrics_addr, &p.worker_id).await);
    assert!(d0 >= 5.0 && p0 >= 2.0, "both engines worked: decode woke {d0} times, prefill {p0}");
    assert!(d1 - d0 <= 5.0, "the decode engine woke {} times in 1 s waiting for a transfer", d1 - d0);
    assert!(p1 - p0 <= 5.0, "the idle prefill engine woke {} times in 1 s", p1 - p0);
    // Still served: a cancelled client is noticed without polling, and its pages come back.
    assert_eq!(stage(&d, "transfer"), 1);
    drop(s.message());
    drop(s);
    until("the cancelled room's pages back", || d.load().free_pages == d.load().total_pages).await;
    c.generate(&prompt(40), &greedy(4)).await.expect("served after the wait");
    settle(&p, std::slice::from_ref(&d)).await;
    d.stop().await;
    p.stop().await;
}

/// A stand-in prefill worker for the router: healthy and loaded, its `Prefill` never answers
/// and its `Bootstrap` accepts the handshake and sends nothing ([`Stalling`]): the request
/// waits, silent, with the decode worker holding its pages.
struct Silent;

#[tonic::async_trait]
impl pb::prefill_server::Prefill for Silent {
    async fn prefill(
        &self,
        _req: tonic::Request<pb::PrefillRequest>,
    ) -> Result<tonic::Response<pb::PrefillResponse>, tonic::Status> {
        std::future::pending().await
    }

    async fn abort(
        &self,
        _req: tonic::Request<pb::AbortRequest>,
    ) -> Result<tonic::Response<pb::AbortResponse>, tonic::Status> {
        Ok(tonic::Response::new(pb::AbortResponse { found: false }))
    }
}

#[tonic::async_trait]
impl pb::load_server::Load for Silent {
    async fn report(
        &self,
        _req: tonic::Request<pb::LoadRequest>,
    ) -> Result<tonic::Response<pb::LoadReport>, tonic::Status> {
        Ok(tonic::Response::new(pb::LoadReport { free_pages: 1024, total_pages: 1024, ..Default::default() }))
    }
}

/// Issue 21: a client gone while the workers are silent ends its request at once. The
/// router's request task used to notice a gone client only when it sent a piece, so a request
/// waiting for its first token kept its decode call, and the decode worker its pages, until
/// the worker gave up (its waiting timeout, 60 s here).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_gone_while_the_workers_are_silent_frees_the_decode_workers_pages() {
    let m = TinyModel::new();
    let (_, mut da) = args(&m);
    da.worker.waiting_timeout = 60.0;
    da.worker.bootstrap_timeout = 60.0;
    let d = ferry_decode::start(da).await.expect("decode up");
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let silent = l.local_addr().expect("addr");
    let (health, health_svc) = tonic_health::server::health_reporter();
    health.set_service_status("", tonic_health::ServingStatus::Serving).await;
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(health_svc)
            .add_service(pb::prefill_server::PrefillServer::new(Silent))
            .add_service(pb::load_server::LoadServer::new(Silent))
            .add_service(pb::bootstrap_server::BootstrapServer::new(Stalling { pages: 0, mid_frame: false }))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(l)),
    );
    let r = ferry_router::start(ferry_router::RouterArgs::new(
        m.path(),
        vec![silent.to_string()],
        vec![d.grpc_addr.to_string()],
    ))
    .await
    .expect("router up");
    until("both workers healthy", || r.ready(1, 1)).await;
    let mut c = pb::router_client::RouterClient::new(channel(r.grpc_addr).await);
    let req = pb::GenerateRequest {
        prompt: Some(pb::generate_request::Prompt::TokenIds(pb::TokenIds { ids: prompt(100) })),
        sampling: Some(ferry_cluster::wire::sampling_to_proto(&greedy(4))),
        ..Default::default()
    };
    let stream = c.generate(req).await.expect("accepted").into_inner();
    until("the decode worker holds the request's pages", || d.load().free_pages < d.load().total_pages).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(d.load().free_pages < d.load().total_pages, "still silent, still held");
    drop(stream);
    until("the decode worker's pages back", || d.load().free_pages == d.load().total_pages).await;
    r.stop().await;
    d.stop().await;
}

/// A prefill node whose pooled data-plane connection to a decode node broke while idle does
/// not leave the next room hanging. Before, that room's first send failed ("Broken pipe")
/// and its prefill call ended while the decode room, which had not seen a byte, waited out
/// its waiting timeout (60 s here): the chaos suite's reuse phase met this after a data-plane
/// cut (a direct caller, with no router to cancel its decode call, hung). Now the pool
/// replaces a sender whose connection it saw end, so the room completes; and should a
/// connection break between the handshake and the first send, the room task aborts the room
/// on the decode node over a new connection ("the prefill node's connection broke").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_data_connection_broken_while_idle_hangs_no_room() {
    let m = TinyModel::new();
    let (pa, mut da) = args(&m);
    let mut pa = pa;
    for w in [&mut pa.worker, &mut da.worker] {
        w.waiting_timeout = 60.0;
        w.transfer_timeout = 30.0;
    }
    // The decode node's data port behind a proxy that can cut its connections.
    let port = std::net::TcpListener::bind("127.0.0.1:0").expect("a free port").local_addr().expect("addr").port();
    da.worker.transfer_addr = format!("127.0.0.1:{port}").parse().expect("addr");
    let proxy = ferry_tests::proxy::Proxy::start(format!("127.0.0.1:{port}")).await;
    da.worker.transfer_advertise_addr = Some(proxy.addr().to_string());
    let p = ferry_prefill::start(pa).await.expect("prefill up");
    let d = ferry_decode::start(da).await.expect("decode up");
    let pair = |n: u32| {
        let key = ferry_cluster::wire::room_key_to_proto(&RoomKey::random());
        let sampling = ferry_cluster::wire::sampling_to_proto(&greedy(4));
        let dreq = pb::DecodeRequest {
            request_id: format!("pair-{n}"),
            room: Some(key.clone()),
            prefill_bootstrap_addr: p.grpc_addr.to_string(),
            token_ids: prompt(300),
            sampling: Some(sampling.clone()),
        };
        let preq = pb::PrefillRequest {
            request_id: format!("pair-{n}"),
            room: Some(key),
            token_ids: prompt(300),
            sampling: Some(sampling),
            priority: 0,
            pull_from: String::new(),
        };
        let (dg, pg) = (d.grpc_addr, p.grpc_addr);
        async move {
            let mut dc = pb::decode_client::DecodeClient::new(channel(dg).await);
            let mut pc = pb::prefill_client::PrefillClient::new(channel(pg).await);
            let decode = async move {
                let mut s = dc.generate(dreq).await?.into_inner();
                while s.message().await?.is_some() {}
                Ok::<_, tonic::Status>(())
            };
            tokio::join!(decode, async move { pc.prefill(preq).await.map(|_| ()) })
        }
    };
    // The first room opens the prefill node's connection to the decode node and completes.
    let (dr, pr) = pair(1).await;
    dr.expect("the first decode call");
    pr.expect("the first prefill call");
    // The connection breaks while idle; the next room's sends meet it.
    proxy.cut();
    proxy.restore();
    let t = std::time::Instant::now();
    let (dr, pr) = tokio::time::timeout(Duration::from_secs(20), pair(2))
        .await
        .expect("both calls end long before the 60 s waiting timeout");
    let took = t.elapsed();
    println!("the calls ended {took:?} after the cut: decode {dr:?}, prefill {pr:?}");
    match (dr, pr) {
        // The pool saw the connection end and connected anew.
        (Ok(()), Ok(())) => {}
        // It broke under the room: the decode node was told.
        (Err(e), Err(_)) => assert!(e.message().contains("prefill node's connection broke"), "{e:?}"),
        other => panic!("the two calls disagree: {other:?}"),
    }
    assert!(took < Duration::from_secs(15), "ended after {took:?}");
    settle(&p, std::slice::from_ref(&d)).await;
    d.stop().await;
    p.stop().await;
}
