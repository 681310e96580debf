//! The KV data plane under the daemons' mutual TLS (`InternalTls::data_plane`): a decode
//! node's receiver serves only senders whose certificate names a prefill node, a prefill node
//! sends only to a receiver whose certificate names a decode node, and strangers (plaintext,
//! no certificate, another CA, another role) get no byte into a room — on the tcp backend and
//! on the rdma connection exchange (in-memory verbs), which hands out a queue pair and the
//! arena's address only inside the handshake. Refusals are counted by reason. Pulls of held
//! pages (`InternalTls::pull_plane`) run the other way with the roles swapped.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use ferry_cluster::mtls::InternalTls;
use ferry_cluster::{Room, RoomSecret};
use ferry_tests::pki::{Leaf, PeerRole, Pki};
use ferry_transfer::frame::Aux;
use ferry_transfer::memory::HostPages;
use ferry_transfer::rdma::mem::MemVerbs;
use ferry_transfer::rdma::{RdmaConfig, RdmaReceiver, RdmaSender};
use ferry_transfer::runs::PageRun;
use ferry_transfer::secure::Security;
use ferry_transfer::table::Outcome;
use ferry_transfer::tcp::{NoFaults, TcpConfig, TcpReceiver, TcpSender};

const PAGE: usize = 512;
const PAGES: usize = 16;

fn security(pki: &Pki, leaf: &Leaf) -> Security {
    ferry_worker::data_plane::data_plane(&InternalTls::load(&pki.args(leaf)).expect("tls files").expect("mutual TLS"))
}

fn any() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 0))
}

fn refused(reason: &str) -> f64 {
    let body = ferry_cluster::exporter::handle().expect("the process recorder").render();
    ferry_tests::metric_sum(&body, "ferry_transfer_connections_refused_total", &format!("reason=\"{reason}\""))
}

/// Waits (up to 5 s) until the refusals for `reason` pass `before`: the receiver counts a
/// refusal when its side of the handshake ends, which may be after the client's.
async fn counted_more(reason: &str, before: f64) -> f64 {
    for _ in 0..100 {
        let now = refused(reason);
        if now > before {
            return now;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("the refusal ({reason}) was not counted: still {before}");
}

fn source() -> Arc<HostPages> {
    let m = HostPages::new(PAGE, PAGES).expect("arena");
    for p in 0..PAGES as u32 {
        let bytes: Vec<u8> = (0..PAGE).map(|i| (p as usize * 31 + i * 3 + 7) as u8).collect();
        // SAFETY: the test owns the arena.
        unsafe { m.write(p, &bytes).expect("write") };
    }
    Arc::new(m)
}

fn page(m: &HostPages, p: u32) -> Vec<u8> {
    // SAFETY: read after the room ended; nothing writes it.
    unsafe { m.read(p, 1).expect("read").to_vec() }
}

fn tcp_cfg() -> TcpConfig {
    TcpConfig { connections: 2, ..TcpConfig::default() }
}

/// Sends pages 0..4 into destination pages 8..12 of a room the receiver opened.
async fn send_room(sender: &TcpSender, src: &HostPages, room: Room, secret: RoomSecret) -> std::io::Result<()> {
    sender.send_pages(room, secret, &[PageRun { src: 0, dst: 8, len: 4 }], src).await?;
    let aux = Aux { first_token: 1, logprob: 0.0, room_echo: room.get(), total_pages: 4 };
    sender.send_done(room, secret, aux).await
}

/// A room of 4 pages sent by a sender with `security` arrives whole in `receiver`.
async fn arrives_whole(receiver: &TcpReceiver, rx_mem: &HostPages, src: &HostPages, security: &Security) {
    let (room, secret) = (Room::from(1u32), RoomSecret::random());
    let done = receiver.open(room, secret, &[8, 9, 10, 11]).expect("open");
    let at = receiver.local_addr();
    let sender = TcpSender::connect_secure(at, tcp_cfg(), security, Arc::new(NoFaults)).await.expect("connect");
    send_room(&sender, src, room, secret).await.expect("sent and acknowledged");
    assert!(matches!(done.await, Ok(Outcome::Success(_))));
    for (s, d) in (0..4).zip(8..12) {
        assert_eq!(page(rx_mem, d), page(src, s), "page {s} -> {d}");
    }
    receiver.close(room);
}

/// A sender with `security`, whose role `receiver` does not serve, writes nothing into a live
/// room (`what` names it); the refusal is counted.
async fn wrong_role_lands_nothing(
    receiver: &TcpReceiver,
    rx_mem: &HostPages,
    src: &HostPages,
    security: &Security,
    what: &str,
) {
    let (room, secret) = (Room::from(3u32), RoomSecret::random());
    let _open = receiver.open(room, secret, &[8, 9, 10, 11]).expect("open");
    // SAFETY: nothing else touches the arena now.
    unsafe { rx_mem.write(8, &vec![0u8; PAGE]).expect("clear") };
    let roles = refused("wrong_role");
    match TcpSender::connect_secure(receiver.local_addr(), tcp_cfg(), security, Arc::new(NoFaults)).await {
        Err(_) => {}
        Ok(s) => {
            let sent = tokio::time::timeout(Duration::from_secs(10), send_room(&s, src, room, secret)).await;
            assert!(!matches!(sent, Ok(Ok(()))), "{what}");
        }
    }
    counted_more("wrong_role", roles).await;
    assert_eq!(page(rx_mem, 8), vec![0u8; PAGE], "{what}: nothing landed");
    receiver.close(room);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_tcp_data_plane_runs_mutual_tls_between_prefill_and_decode_only() {
    let pki = Pki::new("data plane CA");
    let names = ["127.0.0.1", "localhost"];
    let prefill = security(&pki, &pki.issue("prefill", Some(PeerRole::Prefill), &names));
    let decode = security(&pki, &pki.issue("decode", Some(PeerRole::Decode), &names));
    let router = security(&pki, &pki.issue("router", Some(PeerRole::Router), &names));
    let other = Pki::new("another CA");
    let stranger = security(&other, &other.issue("prefill", Some(PeerRole::Prefill), &names));

    let src = source();
    let rx_mem = Arc::new(HostPages::new(PAGE, PAGES).expect("arena"));
    let receiver = TcpReceiver::bind_secure(any(), Arc::clone(&rx_mem), tcp_cfg(), decode).await.expect("bind");
    let at = receiver.local_addr();

    // A prefill node's pages arrive whole, over TLS.
    arrives_whole(&receiver, &rx_mem, &src, &prefill).await;

    // Strangers, each with a live room's key: nothing lands, each refusal is counted.
    let (room, secret) = (Room::from(2u32), RoomSecret::random());
    let _open = receiver.open(room, secret, &[8, 9, 10, 11]).expect("open");
    // SAFETY: nothing else touches the arena now.
    unsafe { rx_mem.write(8, &vec![0u8; PAGE]).expect("clear") };
    let handshakes = refused("tls_handshake");
    let plain = TcpSender::connect(at, tcp_cfg()).await.expect("tcp connects");
    let sent = tokio::time::timeout(Duration::from_secs(10), send_room(&plain, &src, room, secret)).await;
    assert!(!matches!(sent, Ok(Ok(()))), "a plaintext sender is not acknowledged");
    let handshakes = counted_more("tls_handshake", handshakes).await;
    let e = TcpSender::connect_secure(at, tcp_cfg(), &stranger, Arc::new(NoFaults)).await;
    let e = match e {
        Err(e) => e.to_string(),
        Ok(s) => send_room(&s, &src, room, secret).await.expect_err("another CA's certificate").to_string(),
    };
    assert!(!e.is_empty());
    counted_more("tls_handshake", handshakes).await;
    let roles = refused("wrong_role");
    match TcpSender::connect_secure(at, tcp_cfg(), &router, Arc::new(NoFaults)).await {
        Err(_) => {}
        Ok(s) => {
            let sent = tokio::time::timeout(Duration::from_secs(10), send_room(&s, &src, room, secret)).await;
            assert!(!matches!(sent, Ok(Ok(()))), "the router's certificate writes no KV");
        }
    }
    counted_more("wrong_role", roles).await;
    assert_eq!(page(&rx_mem, 8), vec![0u8; PAGE], "no stranger's byte landed");

    // A prefill node refuses a receiver that is not a decode node (a prefill certificate).
    let fake = TcpReceiver::bind_secure(any(), Arc::new(HostPages::new(PAGE, PAGES).expect("arena")), tcp_cfg(), {
        security(&pki, &pki.issue("impostor", Some(PeerRole::Prefill), &names))
    })
    .await
    .expect("bind");
    let e = TcpSender::connect_secure(fake.local_addr(), tcp_cfg(), &prefill, Arc::new(NoFaults))
        .await
        .expect_err("a prefill node posing as a decode node");
    assert!(e.to_string().contains("is not a decode node"), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_rdma_connection_exchange_runs_inside_mutual_tls() {
    let pki = Pki::new("rdma data plane CA");
    let names = ["127.0.0.1"];
    let prefill = security(&pki, &pki.issue("prefill", Some(PeerRole::Prefill), &names));
    let decode = security(&pki, &pki.issue("decode", Some(PeerRole::Decode), &names));
    let router = security(&pki, &pki.issue("router", Some(PeerRole::Router), &names));
    let verbs = Arc::new(MemVerbs::new());
    let rx_mem = Arc::new(HostPages::new(PAGE, PAGES).expect("arena"));
    let cfg = RdmaConfig::default();
    let r = RdmaReceiver::bind(any(), Arc::clone(&verbs), rx_mem, cfg, decode).await.expect("bind");
    let (room, secret) = (Room::from(3u32), RoomSecret::random());
    let _open = r.open(room, secret, &[1, 2]).expect("open");
    let connect = |security: Security| {
        let (verbs, at) = (Arc::clone(&verbs), r.local_addr());
        async move { RdmaSender::connect(at, verbs, source(), cfg, (room, &secret), &security).await }
    };
    // With the room's key but without TLS, or with the router's certificate: no queue pair, no
    // address, and the key stays unused.
    let handshakes = refused("tls_handshake");
    connect(Security::Plain).await.expect_err("plaintext");
    counted_more("tls_handshake", handshakes).await;
    let roles = refused("wrong_role");
    connect(router).await.expect_err("the router's certificate");
    counted_more("wrong_role", roles).await;
    let s = connect(prefill).await.expect("a prefill node with the room's key");
    assert_eq!(s.region().pages, PAGES as u64);
}

fn pull_security(pki: &Pki, leaf: &Leaf) -> Security {
    ferry_worker::data_plane::pull_plane(&InternalTls::load(&pki.args(leaf)).expect("tls files").expect("mutual TLS"))
}

/// Pulls (issue 20) run the data plane the other way, the roles swapped: a prefill node's
/// pull receiver takes held pages from decode nodes only, and a decode node sends them to
/// prefill nodes only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pulls_run_mutual_tls_from_decode_to_prefill_only() {
    let pki = Pki::new("pull plane CA");
    let names = ["127.0.0.1", "localhost"];
    let prefill = pull_security(&pki, &pki.issue("prefill", Some(PeerRole::Prefill), &names));
    let decode = pull_security(&pki, &pki.issue("decode", Some(PeerRole::Decode), &names));
    let src = source();
    let rx_mem = Arc::new(HostPages::new(PAGE, PAGES).expect("arena"));
    let receiver =
        TcpReceiver::bind_secure(any(), Arc::clone(&rx_mem), tcp_cfg(), prefill.clone()).await.expect("bind");

    // A decode node's held pages arrive whole; another prefill node writes nothing.
    arrives_whole(&receiver, &rx_mem, &src, &decode).await;
    wrong_role_lands_nothing(&receiver, &rx_mem, &src, &prefill, "a prefill certificate pushes no pages").await;

    // A decode node sends held pages to no decode node's receiver.
    let impostor = TcpReceiver::bind_secure(any(), Arc::new(HostPages::new(PAGE, PAGES).expect("arena")), tcp_cfg(), {
        pull_security(&pki, &pki.issue("impostor", Some(PeerRole::Decode), &names))
    })
    .await
    .expect("bind");
    let e = TcpSender::connect_secure(impostor.local_addr(), tcp_cfg(), &decode, Arc::new(NoFaults)).await;
    assert!(e.is_err(), "a decode node talks to prefill nodes only when it sends held pages");
}
