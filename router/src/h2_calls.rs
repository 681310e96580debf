//! The calls on a request's path (the router's `Prefill` and `Generate`) over an HTTP/2
//! connection of their own, each request sent in one write.
//!
//! hyper's client, under tonic's channels, writes a call in three: h2 gives a new stream send
//! capacity only once its connection task has opened the stream, so hyper's body pipe waits
//! for the HEADERS frame to be written before it hands over the DATA, and the body's end
//! follows in an empty DATA frame of its own. A loopback write runs the receiver's TCP stack
//! and wakes it (~10 µs of the sender's CPU each): a routed request made six writes for its
//! two calls. Here the whole body goes to h2, with its end, before the connection task runs,
//! and the task writes HEADERS and DATA together: one write a call while the body fits one
//! frame (16 KiB, the servers' frame size: a ~6,000-token prompt), then one a frame.
//!
//! [`Calls`] is a tower service of `http::Request<tonic::body::Body>`: tonic's own
//! [`tonic::client::Grpc`] encodes the message and reads the answer over it. It connects on
//! first use (TCP, or the cluster's mutual TLS with the role check of [`ferry_cluster::dial`]), dials
//! again once its connection is gone (a request the peer never saw is sent again there, once),
//! and, like the channels, pings the peer while calls are open ([`KEEPALIVE_INTERVAL`], also
//! while answers flow): a peer that stops answering fails the calls on it with UNAVAILABLE
//! within [`KEEPALIVE_TIMEOUT`] more. Other failures get the statuses tonic's channels gave. A request body is gathered whole before it
//! is sent: this is for unary and server-streaming calls, not client streaming.

use parking_lot::Mutex;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::task::{Context, Poll, ready};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame};
use http_body_util::BodyExt as _;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;
use tonic::Status;

use ferry_cluster::dial::Target;
use ferry_cluster::mtls::{BadAddress, InternalTls, KEEPALIVE_INTERVAL, KEEPALIVE_TIMEOUT};
use ferry_cluster::roles::PeerRole;

/// A stream's receive window, as hyper's client (tonic's channels keep hyper's defaults).
const STREAM_WINDOW: u32 = 2 << 20;
/// The connection's receive window, as hyper's client.
const CONN_WINDOW: u32 = 5 << 20;

/// Calls to one daemon, each request in one write; cheap to clone (one connection).
#[derive(Clone)]
pub struct Calls {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Calls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Calls").field("origin", &self.inner.origin).finish()
    }
}

struct Inner {
    /// `http://host:port` or `https://host:port`: what tonic's client puts before a path.
    origin: http::Uri,
    dialer: Dialer,
    connect_timeout: Duration,
    call_timeout: Duration,
    /// How often an open call's connection is pinged, and how long an answer may take.
    keepalive: (Duration, Duration),
    /// The connection, once dialled.
    live: Mutex<Option<Live>>,
    /// One dial at a time.
    dialing: tokio::sync::Mutex<()>,
}

enum Dialer {
    Plain(String),
    Tls(Target),
}

#[derive(Clone)]
struct Live {
    send: h2::client::SendRequest<Bytes>,
    state: Arc<ConnState>,
}

/// What the connection's task and its calls share.
#[derive(Default)]
struct ConnState {
    /// Calls waiting for or reading an answer (pings go out only while there are some).
    open: AtomicUsize,
    /// The task ended: the connection is gone.
    closed: AtomicBool,
    /// It ended because a ping went unanswered.
    timed_out: AtomicBool,
}

impl Calls {
    /// Calls to the daemon of role `expect` at `addr` (`host:port` or a URI), over mutual TLS
    /// when `tls` is given; each connect within `connect_timeout`, each answer's head within
    /// `call_timeout`. Connects on first use.
    pub fn new(
        addr: &str,
        tls: Option<&InternalTls>,
        expect: PeerRole,
        connect_timeout: Duration,
        call_timeout: Duration,
    ) -> Result<Self, BadAddress> {
        ferry_cluster::mtls::check_scheme(addr, tls.is_some())?;
        let host_port = ferry_cluster::dial::host_port(addr);
        let (scheme, dialer) = match tls {
            Some(tls) => ("https", Dialer::Tls(Target::new(addr, tls, expect)?)),
            None => ("http", Dialer::Plain(host_port.clone())),
        };
        let origin = format!("{scheme}://{host_port}").parse().map_err(|e| BadAddress(format!("{addr}: {e}")))?;
        let (live, dialing) = (Mutex::new(None), tokio::sync::Mutex::new(()));
        let keepalive = (KEEPALIVE_INTERVAL, KEEPALIVE_TIMEOUT);
        let inner = Inner { origin, dialer, connect_timeout, call_timeout, keepalive, live, dialing };
        Ok(Self { inner: Arc::new(inner) })
    }

    /// The URI before a call's path (for [`tonic::client::Grpc::with_origin`]).
    pub fn origin(&self) -> &http::Uri {
        &self.inner.origin
    }
}

impl tower::Service<http::Request<tonic::body::Body>> for Calls {
    type Response = http::Response<Answer>;
    type Error = Status;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Status>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Status>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<tonic::body::Body>) -> Self::Future {
        let inner = Arc::clone(&self.inner);
        Box::pin(async move { inner.call(req).await })
    }
}

impl Inner {
    async fn call(&self, req: http::Request<tonic::body::Body>) -> Result<http::Response<Answer>, Status> {
        let (parts, body) = req.into_parts();
        let body = body.collect().await?.to_bytes();
        let head = || {
            let mut r = http::Request::new(());
            *r.method_mut() = parts.method.clone();
            *r.uri_mut() = parts.uri.clone();
            *r.headers_mut() = parts.headers.clone();
            r
        };
        // A request that never reached the peer is sent again on a new connection, once: the
        // connection was found closed before the request left, or the peer was going away
        // (GOAWAY without an error) and refused its stream unprocessed.
        let mut retried = false;
        loop {
            let live = self.live().await?;
            let sent = match live.send.clone().ready().await {
                Ok(mut send) => send.send_request(head(), body.is_empty()),
                Err(e) => Err(e),
            };
            let answer = match sent {
                Ok((answer, mut stream)) => {
                    // Fails only when the stream already ended; the answer then says why.
                    let _ = if body.is_empty() { Ok(()) } else { stream.send_data(body.clone(), true) };
                    answer
                }
                Err(e) if !retried && !e.is_reset() => {
                    self.forget(&live);
                    retried = true;
                    continue;
                }
                Err(e) => return Err(status_of(&e, &live.state)),
            };
            let open = Open::new(&live.state);
            let head = match tokio::time::timeout(self.call_timeout, answer).await {
                Err(_) => return Err(Status::cancelled("Timeout expired")),
                Ok(Err(e)) if !retried && refused_unprocessed(&e) => {
                    self.forget(&live);
                    retried = true;
                    continue;
                }
                Ok(Err(e)) => return Err(status_of(&e, &live.state)),
                Ok(Ok(head)) => head,
            };
            return Ok(head.map(|recv| Answer { recv, data_done: false, open }));
        }
    }

    /// The open connection, or a new one.
    async fn live(&self) -> Result<Live, Status> {
        if let Some(live) = self.cached() {
            return Ok(live);
        }
        let _one = self.dialing.lock().await;
        if let Some(live) = self.cached() {
            return Ok(live);
        }
        let live = tokio::time::timeout(self.connect_timeout, self.dial())
            .await
            .map_err(|_| Status::unavailable(format!("connecting to {}: timed out", self.origin)))?
            .map_err(|e| Status::unavailable(format!("connecting to {}: {e}", self.origin)))?;
        *self.live.lock() = Some(live.clone());
        Ok(live)
    }

    fn cached(&self) -> Option<Live> {
        let live = self.live.lock();
        live.as_ref().filter(|l| !l.state.closed.load(Ordering::Acquire)).cloned()
    }

    /// Drops `live` unless another call already replaced it.
    fn forget(&self, live: &Live) {
        let mut cur = self.live.lock();
        if cur.as_ref().is_some_and(|c| Arc::ptr_eq(&c.state, &live.state)) {
            *cur = None;
        }
    }

    async fn dial(&self) -> std::io::Result<Live> {
        match &self.dialer {
            Dialer::Plain(host_port) => {
                let tcp = TcpStream::connect(host_port).await?;
                tcp.set_nodelay(true)?;
                handshake(tcp, self.keepalive).await
            }
            Dialer::Tls(target) => handshake(target.connect().await?, self.keepalive).await,
        }
    }
}

/// HTTP/2 over `io`, its connection driven by a task of its own that pings every
/// `keepalive.0` while calls are open and gives up on an answer after `keepalive.1`.
async fn handshake<T: AsyncRead + AsyncWrite + Unpin + Send + 'static>(
    io: T,
    keepalive: (Duration, Duration),
) -> std::io::Result<Live> {
    let (send, mut conn) = h2::client::Builder::new()
        .initial_window_size(STREAM_WINDOW)
        .initial_connection_window_size(CONN_WINDOW)
        .enable_push(false)
        .handshake::<_, Bytes>(io)
        .await
        .map_err(std::io::Error::other)?;
    let state = Arc::new(ConnState::default());
    let ping = conn.ping_pong().ok_or_else(|| std::io::Error::other("h2 gave no ping handle"))?;
    let mut tick = tokio::time::interval(keepalive.0);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tokio::spawn(Drive { conn, ping, state: Arc::clone(&state), tick, patience: keepalive.1, waiting: None });
    Ok(Live { send, state })
}

/// Drives a connection; at every tick while calls are open it pings the peer, and ends the
/// connection (failing its calls) when no answer comes within `patience`.
struct Drive<T> {
    conn: h2::client::Connection<T, Bytes>,
    ping: h2::PingPong,
    state: Arc<ConnState>,
    tick: tokio::time::Interval,
    patience: Duration,
    /// The unanswered ping's deadline.
    waiting: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl<T: AsyncRead + AsyncWrite + Unpin> Future for Drive<T> {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let me = self.get_mut();
        loop {
            if let Poll::Ready(r) = Pin::new(&mut me.conn).poll(cx) {
                if let Err(e) = r {
                    tracing::debug!(error = %e, "calls connection ended");
                }
                break;
            }
            if let Some(deadline) = me.waiting.as_mut() {
                match me.ping.poll_pong(cx) {
                    Poll::Ready(Ok(_)) => me.waiting = None,
                    Poll::Ready(Err(_)) => break,
                    Poll::Pending if deadline.as_mut().poll(cx).is_ready() => {
                        me.state.timed_out.store(true, Ordering::Release);
                        break;
                    }
                    Poll::Pending => {}
                }
            }
            if me.tick.poll_tick(cx).is_ready() {
                if me.waiting.is_none()
                    && me.state.open.load(Ordering::Acquire) > 0
                    && me.ping.send_ping(h2::Ping::opaque()).is_ok()
                {
                    me.waiting = Some(Box::pin(tokio::time::sleep(me.patience)));
                }
                continue;
            }
            return Poll::Pending;
        }
        me.state.closed.store(true, Ordering::Release);
        Poll::Ready(())
    }
}

/// A call waiting for or reading its answer.
struct Open(Arc<ConnState>);

impl Open {
    fn new(state: &Arc<ConnState>) -> Self {
        state.open.fetch_add(1, Ordering::AcqRel);
        Self(Arc::clone(state))
    }
}

impl Drop for Open {
    fn drop(&mut self) {
        self.0.open.fetch_sub(1, Ordering::AcqRel);
    }
}

/// An answer's body: its DATA (the receive window given back as it is read), then its
/// trailers. Dropped before its end, it resets the stream (the peer sees the call cancelled).
pub struct Answer {
    recv: h2::RecvStream,
    data_done: bool,
    open: Open,
}

impl Body for Answer {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        let me = self.get_mut();
        if !me.data_done {
            match ready!(me.recv.poll_data(cx)) {
                Some(Ok(data)) => {
                    let _ = me.recv.flow_control().release_capacity(data.len());
                    return Poll::Ready(Some(Ok(Frame::data(data))));
                }
                Some(Err(e)) => return Poll::Ready(Some(Err(status_of(&e, &me.open.0)))),
                None => me.data_done = true,
            }
        }
        match ready!(me.recv.poll_trailers(cx)) {
            Ok(Some(t)) => Poll::Ready(Some(Ok(Frame::trailers(t)))),
            Ok(None) => Poll::Ready(None),
            Err(e) => Poll::Ready(Some(Err(status_of(&e, &me.open.0)))),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.recv.is_end_stream()
    }
}

/// A stream the peer refused in a GOAWAY without an error: it was never processed.
fn refused_unprocessed(e: &h2::Error) -> bool {
    e.is_go_away() && e.is_remote() && e.reason() == Some(h2::Reason::NO_ERROR)
}

/// The gRPC status of an HTTP/2 failure, as tonic's channels gave it (the mapping of gRPC's
/// HTTP/2 document; UNKNOWN for a broken connection), except that a peer that stopped
/// answering pings is UNAVAILABLE, as hyper's keep-alive timeout was.
fn status_of(e: &h2::Error, conn: &ConnState) -> Status {
    if conn.timed_out.load(Ordering::Acquire) {
        return Status::unavailable("the peer stopped answering: a keep-alive ping went unanswered");
    }
    use h2::Reason as R;
    let code = match e.reason() {
        Some(R::REFUSED_STREAM) => tonic::Code::Unavailable,
        Some(R::CANCEL) => tonic::Code::Cancelled,
        Some(R::ENHANCE_YOUR_CALM) => tonic::Code::ResourceExhausted,
        Some(R::INADEQUATE_SECURITY) => tonic::Code::PermissionDenied,
        Some(
            R::NO_ERROR
            | R::PROTOCOL_ERROR
            | R::INTERNAL_ERROR
            | R::FLOW_CONTROL_ERROR
            | R::SETTINGS_TIMEOUT
            | R::COMPRESSION_ERROR
            | R::CONNECT_ERROR,
        ) => tonic::Code::Internal,
        _ => tonic::Code::Unknown,
    };
    Status::new(code, format!("h2 protocol error: {e}"))
}

#[cfg(test)]
mod tests;
