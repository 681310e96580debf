//! [`Calls`] against tonic's own server (its health service: a unary and a server-streaming
//! call): one write a call, answers and statuses as tonic's client reads them, dialling
//! again, and a peer that stops answering.

use std::io::IoSlice;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncWrite, DuplexStream, ReadBuf};
use tokio::net::TcpListener;
use tonic::Code;
use tonic_health::ServingStatus;
use tonic_health::pb::health_check_response::ServingStatus as Wire;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::{HealthCheckRequest, health_server::HealthServer};
use tonic_health::server::HealthReporter;

use super::*;

const SECOND: Duration = Duration::from_secs(1);

fn calls(addr: &str) -> Calls {
    Calls::new(addr, None, PeerRole::Prefill, SECOND, 10 * SECOND).expect("calls")
}

fn client(c: &Calls) -> HealthClient<Calls> {
    HealthClient::with_origin(c.clone(), c.origin().clone())
}

async fn check(c: &Calls, service: &str) -> Result<i32, Status> {
    let req = HealthCheckRequest { service: service.into() };
    client(c).check(req).await.map(|r| r.into_inner().status)
}

async fn health() -> (HealthReporter, HealthServer<impl tonic_health::pb::health_server::Health>) {
    let (reporter, service) = tonic_health::server::health_reporter();
    reporter.set_service_status("", ServingStatus::Serving).await;
    (reporter, service)
}

/// A loopback listener and its `host:port`.
async fn listen() -> (TcpListener, String) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr").to_string();
    (listener, addr)
}

/// A health server on one connection, `io`.
async fn serve_one<T>(io: T)
where
    T: tonic::transport::server::Connected + AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (_reporter, service) = health().await;
    let incoming = futures::stream::iter([Ok::<_, std::io::Error>(io)]);
    tonic::transport::Server::builder().add_service(service).serve_with_incoming(incoming).await.expect("serve");
}

/// A health server on `listener` until the returned sender fires.
async fn serve(
    listener: TcpListener,
) -> (HealthReporter, tokio::sync::oneshot::Sender<()>, tokio::task::JoinHandle<()>) {
    let (reporter, service) = health().await;
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
    let task = tokio::spawn(async move {
        let server = tonic::transport::Server::builder().add_service(service);
        server.serve_with_incoming_shutdown(incoming, async { drop(stopped.await) }).await.expect("serve");
    });
    (reporter, stop, task)
}

/// One end of an in-memory connection that counts the writes made to it.
struct Counted {
    io: DuplexStream,
    writes: Arc<AtomicUsize>,
}

impl AsyncRead for Counted {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl AsyncWrite for Counted {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        let r = Pin::new(&mut self.io).poll_write(cx, buf);
        if matches!(r, Poll::Ready(Ok(n)) if n > 0) {
            self.writes.fetch_add(1, Ordering::SeqCst);
        }
        r
    }

    /// As a socket's `writev`: every slice in one write.
    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let joined: Vec<u8> = bufs.iter().flat_map(|b| b.iter().copied()).collect();
        self.poll_write(cx, &joined)
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

#[tokio::test]
async fn a_call_leaves_in_one_write() {
    let (client_io, server_io) = tokio::io::duplex(1 << 20);
    tokio::spawn(serve_one(server_io));
    let writes = Arc::new(AtomicUsize::new(0));
    let io = Counted { io: client_io, writes: Arc::clone(&writes) };
    let c = calls("127.0.0.1:1");
    // No ping may fall within a counted call.
    let hour = Duration::from_secs(3600);
    let live = handshake(io, (hour, hour)).await.expect("handshake");
    *c.inner.live.lock() = Some(live);
    // The preface and the settings' exchange.
    assert_eq!(check(&c, "").await.expect("first call"), Wire::Serving as i32);
    tokio::time::sleep(Duration::from_millis(50)).await;
    // A small body (copied into h2's buffer) and a large one (written from its own slice).
    for service in [String::new(), "x".repeat(10_000)] {
        writes.store(0, Ordering::SeqCst);
        let answer = check(&c, &service).await;
        if service.is_empty() {
            assert_eq!(answer.expect("serving"), Wire::Serving as i32);
        } else {
            assert_eq!(answer.expect_err("unknown service").code(), Code::NotFound);
        }
        assert_eq!(
            writes.load(Ordering::SeqCst),
            1,
            "HEADERS and DATA with its end in one write ({} bytes)",
            service.len()
        );
    }
}

#[tokio::test]
async fn answers_streams_and_statuses_read_as_through_a_channel() {
    let (listener, addr) = listen().await;
    let (reporter, _stop, _task) = serve(listener).await;
    let c = calls(&addr);
    assert_eq!(c.origin().to_string(), format!("http://{addr}/"));
    assert_eq!(check(&c, "").await.expect("unary"), Wire::Serving as i32);
    let e = check(&c, "nope").await.expect_err("a status from the server");
    assert_eq!((e.code(), e.message()), (Code::NotFound, "service not registered"));
    // A server stream: the first message, then one sent later on the same call.
    let req = HealthCheckRequest { service: String::new() };
    let mut watch = client(&c).watch(req).await.expect("watch").into_inner();
    assert_eq!(watch.message().await.expect("first").expect("some").status, Wire::Serving as i32);
    reporter.set_service_status("", ServingStatus::NotServing).await;
    assert_eq!(watch.message().await.expect("second").expect("some").status, Wire::NotServing as i32);
    assert_eq!(c.inner.live.lock().as_ref().expect("live").state.open.load(Ordering::SeqCst), 1);
    drop(watch);
    let state = Arc::clone(&c.inner.live.lock().as_ref().expect("live").state);
    assert_eq!(state.open.load(Ordering::SeqCst), 0, "a dropped answer no longer counts as open");
}

#[tokio::test]
async fn a_refused_or_closed_connection_is_dialled_again() {
    // A port nothing listens on: UNAVAILABLE, as a channel's connect error.
    let probe = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = probe.local_addr().expect("addr");
    drop(probe);
    let c = calls(&addr.to_string());
    let e = check(&c, "").await.expect_err("refused");
    assert_eq!(e.code(), Code::Unavailable, "{e}");
    // The peer comes up: the next call dials it.
    let (_r, stop, task) = serve(TcpListener::bind(addr).await.expect("rebind")).await;
    assert_eq!(check(&c, "").await.expect("dialled"), Wire::Serving as i32);
    // It restarts (its connections closed): the next call dials the new one.
    stop.send(()).expect("stop");
    task.await.expect("stopped");
    let (_r, _stop, _task) = serve(TcpListener::bind(addr).await.expect("rebind")).await;
    assert_eq!(check(&c, "").await.expect("dialled again"), Wire::Serving as i32);
}

#[tokio::test]
async fn a_peer_that_stops_answering_fails_open_calls_unavailable() {
    // Accepts, and its kernel acknowledges, but the process never reads or answers: as a
    // frozen worker.
    let (listener, addr) = listen().await;
    let held = tokio::spawn(async move {
        let (socket, _) = listener.accept().await.expect("accept");
        tokio::time::sleep(Duration::from_secs(60)).await;
        drop(socket);
    });
    let mut c = calls(&addr);
    Arc::get_mut(&mut c.inner).expect("sole owner").keepalive =
        (Duration::from_millis(100), Duration::from_millis(300));
    let t = Instant::now();
    let e = check(&c, "").await.expect_err("no answer");
    assert_eq!(e.code(), Code::Unavailable, "{e}");
    assert!(e.message().contains("ping"), "{e}");
    assert!(t.elapsed() < Duration::from_secs(3), "failed after {:?}", t.elapsed());
    held.abort();
}

#[tokio::test]
async fn a_request_refused_by_a_peer_going_away_is_sent_again_on_a_new_connection() {
    let (listener, addr) = listen().await;
    let peer = tokio::spawn(async move {
        // The first connection: HTTP/2 set up, then a GOAWAY without an error before any
        // stream is processed (as a worker that starts draining).
        let (first, _) = listener.accept().await.expect("accept");
        let mut conn = h2::server::handshake(first).await.expect("h2 handshake");
        conn.abrupt_shutdown(h2::Reason::NO_ERROR);
        while let Some(r) = conn.accept().await {
            drop(r);
        }
        // The second: served.
        let (second, _) = listener.accept().await.expect("accept again");
        serve_one(second).await;
    });
    let c = calls(&addr);
    assert_eq!(check(&c, "").await.expect("answered on the second connection"), Wire::Serving as i32);
    peer.abort();
}
