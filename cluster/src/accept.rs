//! Accepted connections with `TCP_NODELAY` set.
//!
//! tonic sets it on connections it accepts itself, but ignores the setting under
//! `serve_with_incoming` (which every Ferry daemon uses, to bind first and to plug in mutual
//! TLS), and axum 0.8's `serve` never sets it. Without it a server's small writes — a streamed
//! token, an SSE event, a short reply after its headers — wait for the peer's delayed ACK
//! (Nagle's algorithm): up to 40 ms on Linux.

use std::io;

use futures::{Stream, StreamExt};
use tokio::net::{TcpListener, TcpStream};

/// `listener`'s connections, each with `TCP_NODELAY` (a failure to set it is logged and the
/// connection kept).
pub fn incoming(listener: TcpListener) -> impl Stream<Item = io::Result<TcpStream>> + Send + 'static {
    tokio_stream::wrappers::TcpListenerStream::new(listener).map(|c| c.inspect(nodelay))
}

/// Sets `TCP_NODELAY` on an accepted connection.
pub fn nodelay(tcp: &TcpStream) {
    if let Err(e) = tcp.set_nodelay(true) {
        tracing::debug!(error = %e, "TCP_NODELAY not set");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn accepted_connections_do_not_wait_for_acks() {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let mut conns = Box::pin(incoming(listener));
        let _client = TcpStream::connect(addr).await.expect("connect");
        let server = conns.next().await.expect("a connection").expect("accepted");
        assert!(server.nodelay().expect("nodelay"), "TCP_NODELAY is off on the accepted side");
    }
}
