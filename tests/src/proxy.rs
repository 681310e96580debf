//! A loopback TCP proxy that can cut the network: every connection through it is dropped and
//! new ones are refused until it is restored. It simulates a partition between two real
//! parts (a router and etcd, say).

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// A running proxy.
pub struct Proxy {
    addr: SocketAddr,
    cut: Arc<AtomicBool>,
    epoch: watch::Sender<u64>,
    task: tokio::task::JoinHandle<()>,
}

impl Proxy {
    /// Forwards a fresh loopback port to `target`.
    pub async fn start(target: String) -> Self {
        let l = TcpListener::bind("127.0.0.1:0").await.expect("bind the proxy");
        let addr = l.local_addr().expect("proxy address");
        let cut = Arc::new(AtomicBool::new(false));
        let (epoch, _) = watch::channel(0u64);
        let (c, e) = (Arc::clone(&cut), epoch.clone());
        let task = tokio::spawn(async move {
            while let Ok((mut inbound, _)) = l.accept().await {
                if c.load(Ordering::SeqCst) {
                    continue; // dropped at once
                }
                let mut gone = e.subscribe();
                let target = target.clone();
                tokio::spawn(async move {
                    let Ok(mut out) = TcpStream::connect(&target).await else { return };
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut inbound, &mut out) => {}
                        _ = gone.changed() => {}
                    }
                });
            }
        });
        Self { addr, cut, epoch, task }
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
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.task.abort();
        self.epoch.send_modify(|e| *e += 1);
    }
}
