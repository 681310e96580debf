//! Data-plane senders: one per receiving endpoint, reused across rooms (a prefill node's to
//! decode nodes; a decode node's to the prefill nodes that pull held pages). Connecting is
//! per destination and bounded: a handshake naming an endpoint that never answers waits
//! [`CONNECT_TIMEOUT`] at most, and only handshakes to that same endpoint wait with it.

use parking_lot::{Mutex, MutexGuard};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use ferry_cluster::{Room, RoomSecret};
use ferry_transfer::backend::{self, TransferConfig};
use ferry_transfer::memory::HostPages;
use ferry_transfer::{BackendKind, Sender};

/// Longest a data-plane connect may take before the handshake fails with UNAVAILABLE.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Default)]
struct Entry {
    sender: Option<Arc<Sender>>,
    /// Held while connecting, so that concurrent handshakes to one endpoint connect once.
    connecting: Arc<tokio::sync::Mutex<()>>,
}

/// The senders, by endpoint.
#[derive(Default)]
pub struct SenderPool {
    entries: Mutex<HashMap<String, Entry>>,
}

impl SenderPool {
    fn entries(&self) -> MutexGuard<'_, HashMap<String, Entry>> {
        self.entries.lock()
    }

    /// The pooled sender to `endpoint`; one whose connection is known to have ended (the
    /// decode node restarted, or a partition cut it while idle) is dropped, so the caller
    /// connects anew instead of failing its room's first send.
    fn connected(&self, endpoint: &str) -> Option<Arc<Sender>> {
        let mut entries = self.entries();
        let e = entries.get_mut(endpoint)?;
        if e.sender.as_ref().is_some_and(|s| s.closed()) {
            e.sender = None;
        }
        e.sender.clone()
    }

    /// The sender to `endpoint`, connecting (within [`CONNECT_TIMEOUT`]) when there is none;
    /// a new connection shows the receiver `room`'s key (the rdma exchange asks for it).
    pub async fn get(
        &self,
        kind: BackendKind,
        endpoint: &str,
        mem: &Arc<HostPages>,
        cfg: &TransferConfig,
        (room, secret): (Room, &RoomSecret),
    ) -> std::io::Result<Arc<Sender>> {
        if let Some(x) = self.connected(endpoint) {
            return Ok(x);
        }
        let connecting = Arc::clone(&self.entries().entry(endpoint.to_string()).or_default().connecting);
        let _one = connecting.lock().await;
        if let Some(x) = self.connected(endpoint) {
            return Ok(x);
        }
        let connect = backend::connect(kind, endpoint, Arc::clone(mem), cfg.clone(), room, secret);
        let connected = match tokio::time::timeout(CONNECT_TIMEOUT, connect).await {
            Ok(r) => r,
            Err(_) => {
                let why = format!("no connection within {CONNECT_TIMEOUT:?}");
                Err(std::io::Error::new(std::io::ErrorKind::TimedOut, why))
            }
        };
        let x = match connected {
            Ok(x) => Arc::new(x),
            Err(e) => {
                // Endpoints named in handshakes come from callers: keep none that never connected.
                let mut entries = self.entries();
                if entries.get(endpoint).is_some_and(|e| e.sender.is_none()) {
                    entries.remove(endpoint);
                }
                return Err(e);
            }
        };
        self.entries().entry(endpoint.to_string()).or_default().sender = Some(Arc::clone(&x));
        Ok(x)
    }

    /// Forgets `sender` (its connection broke): the next handshake for its endpoint reconnects.
    pub fn evict(&self, sender: &Arc<Sender>) {
        for e in self.entries().values_mut() {
            if e.sender.as_ref().is_some_and(|x| Arc::ptr_eq(x, sender)) {
                e.sender = None;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The room key a new connection shows (tcp ignores it).
    fn key() -> (Room, &'static RoomSecret) {
        static SECRET: std::sync::OnceLock<RoomSecret> = std::sync::OnceLock::new();
        (Room::from(1u32), SECRET.get_or_init(RoomSecret::random))
    }

    /// Issue 21's defect 4: one endpoint that never answers a connect (a listener whose
    /// accept queue is full drops SYNs) used to hold the pool's lock across the connect, with
    /// no timeout, stalling every handshake on the node.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_endpoint_that_never_answers_stalls_only_its_own_handshakes() {
        let hole = tokio::net::TcpSocket::new_v4().expect("socket");
        hole.bind("127.0.0.1:0".parse().expect("addr")).expect("bind");
        let hole = hole.listen(0).expect("listen");
        let hole_addr = hole.local_addr().expect("addr");
        // One connection fills the accept queue; later SYNs are dropped.
        let _filler = std::net::TcpStream::connect(hole_addr).expect("fill the queue");
        let mem = Arc::new(HostPages::new(256, 8).expect("arena"));
        let cfg = TransferConfig::default();
        let (receiver, good) =
            backend::bind(BackendKind::Tcp, "127.0.0.1:0".parse().expect("addr"), Arc::clone(&mem), cfg.clone())
                .await
                .expect("a receiver");
        let pool = Arc::new(SenderPool::default());
        let stuck = tokio::spawn({
            let (pool, mem) = (Arc::clone(&pool), Arc::clone(&mem));
            async move {
                let t = std::time::Instant::now();
                let limit = CONNECT_TIMEOUT + Duration::from_secs(2);
                let r = tokio::time::timeout(
                    limit,
                    pool.get(BackendKind::Tcp, &hole_addr.to_string(), &mem, &TransferConfig::default(), key()),
                )
                .await;
                (r.expect("the connect is bounded").map(|_| ()), t.elapsed())
            }
        });
        tokio::time::sleep(Duration::from_millis(200)).await;
        tokio::time::timeout(Duration::from_secs(2), pool.get(BackendKind::Tcp, &good, &mem, &cfg, key()))
            .await
            .expect("the good endpoint does not wait behind the stuck connect")
            .expect("the good endpoint connects");
        let (r, took) = stuck.await.expect("task");
        let e = r.expect_err("the black hole never connects");
        assert_eq!(e.kind(), std::io::ErrorKind::TimedOut, "{e}");
        assert!(took < CONNECT_TIMEOUT + Duration::from_secs(2), "{took:?}");
        assert_eq!(pool.entries().len(), 1, "the endpoint that never connected is not kept");
        drop(receiver);
    }
}
