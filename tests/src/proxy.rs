//! A loopback TCP proxy that can cut the network: every connection through it is dropped and
//! new ones are refused until it is restored. It simulates a partition between two real
//! parts (a router and etcd, say, or a prefill node and a decode node's data plane). It can
//! also delay every chunk it forwards, a slow link, or stall: forward half of a chunk (in
//! the middle of a frame, as a rule) and then nothing, closing nothing, as a frozen or
//! partitioned peer does.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// A running proxy.
pub struct Proxy {
    addr: SocketAddr,
    cut: Arc<AtomicBool>,
    delay_us: Arc<AtomicU64>,
    /// Chunks held for a delay so far.
    delayed: Arc<AtomicU64>,
    stalled: Arc<AtomicBool>,
    epoch: watch::Sender<u64>,
    task: tokio::task::JoinHandle<()>,
}

impl Proxy {
    /// Forwards a fresh loopback port to `target`.
    pub async fn start(target: String) -> Self {
        let l = TcpListener::bind("127.0.0.1:0").await.expect("bind the proxy");
        let addr = l.local_addr().expect("proxy address");
        let cut = Arc::new(AtomicBool::new(false));
        let delay_us = Arc::new(AtomicU64::new(0));
        let delayed = Arc::new(AtomicU64::new(0));
        let stalled = Arc::new(AtomicBool::new(false));
        let (epoch, _) = watch::channel(0u64);
        let (c, e, delay, stall) = (Arc::clone(&cut), epoch.clone(), Arc::clone(&delay_us), Arc::clone(&stalled));
        let held = Arc::clone(&delayed);
        let task = tokio::spawn(async move {
            while let Ok((inbound, _)) = l.accept().await {
                if c.load(Ordering::SeqCst) {
                    continue; // dropped at once
                }
                let mut gone = e.subscribe();
                let target = target.clone();
                let delay = Arc::clone(&delay);
                let stall = Arc::clone(&stall);
                let held = Arc::clone(&held);
                tokio::spawn(async move {
                    let Ok(out) = TcpStream::connect(&target).await else { return };
                    let _ = (inbound.set_nodelay(true), out.set_nodelay(true));
                    let (ri, wi) = inbound.into_split();
                    let (ro, wo) = out.into_split();
                    tokio::select! {
                        _ = pump(ri, wo, Arc::clone(&delay), Arc::clone(&held), Arc::clone(&stall)) => {}
                        _ = pump(ro, wi, delay, held, stall) => {}
                        _ = gone.changed() => {}
                    }
                });
            }
        });
        Self { addr, cut, delay_us, delayed, stalled, epoch, task }
    }

    /// Its address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Drops every connection and refuses new ones.
    pub fn cut(&self) {
        self.cut.store(true, Ordering::SeqCst);
        self.epoch.send_modify(|e| *e += 1);
    }

    /// Lets connections through again.
    pub fn restore(&self) {
        self.cut.store(false, Ordering::SeqCst);
    }

    /// Stalls every connection (`true`): the chunk in hand is forwarded up to its middle, then
    /// nothing more until `false`, and nothing is closed.
    pub fn stall(&self, on: bool) {
        self.stalled.store(on, Ordering::SeqCst);
    }

    /// Holds every chunk read from either side for `d` before forwarding it (zero: none).
    pub fn delay(&self, d: Duration) {
        self.delay_us.store(d.as_micros() as u64, Ordering::SeqCst);
    }

    /// Chunks held for a delay so far (a delay that held none slowed nothing).
    pub fn delayed(&self) -> u64 {
        self.delayed.load(Ordering::SeqCst)
    }
}

/// Copies `from` to `to`, one read at a time, each held for the current delay; while
/// stalled, stops in the middle of a chunk.
async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    delay_us: Arc<AtomicU64>,
    delayed: Arc<AtomicU64>,
    stalled: Arc<AtomicBool>,
) {
    let mut buf = vec![0u8; 256 << 10];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        let d = delay_us.load(Ordering::Relaxed);
        if d > 0 {
            tokio::time::sleep(Duration::from_micros(d)).await;
            delayed.fetch_add(1, Ordering::SeqCst);
        }
        let mut from_byte = 0;
        if stalled.load(Ordering::SeqCst) {
            from_byte = n / 2;
            if to.write_all(&buf[..from_byte]).await.is_err() {
                break;
            }
            while stalled.load(Ordering::SeqCst) {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
        if to.write_all(&buf[from_byte..n]).await.is_err() {
            break;
        }
    }
    let _ = to.shutdown().await;
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.task.abort();
        self.epoch.send_modify(|e| *e += 1);
    }
}
