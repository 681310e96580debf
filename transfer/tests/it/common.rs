//! Helpers shared by the transfer test binaries.

use std::net::SocketAddr;
use std::time::Duration;

use ferry_transfer::memory::HostPages;
use ferry_transfer::room::Timeouts;
use ferry_transfer::table::Outcome;
use ferry_transfer::tcp::TcpConfig;

pub const PAGE: usize = 256;
pub const PAGES: usize = 64;

pub fn any_addr() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 0))
}

pub fn cfg() -> TcpConfig {
    let s = Duration::from_secs(2);
    TcpConfig { connections: 3, max_frame_pages: 4, timeouts: Timeouts { bootstrap: s, waiting: s, transferring: s } }
}

/// A source arena whose every byte is a function of (page, offset).
pub fn source() -> HostPages {
    let m = HostPages::new(PAGE, PAGES).expect("arena");
    for p in 0..PAGES as u32 {
        let bytes: Vec<u8> = (0..PAGE).map(|i| (p as usize * 131 + i * 7 + 1) as u8).collect();
        // SAFETY: the test owns the arena.
        unsafe { m.write(p, &bytes).expect("write") };
    }
    m
}

pub fn page(m: &HostPages, p: u32) -> Vec<u8> {
    // SAFETY: read after the room ended; nothing writes it.
    unsafe { m.read(p, 1).expect("read").to_vec() }
}

pub struct Rng(pub u64);
impl Rng {
    pub fn next(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
    pub fn pick(&mut self, n: usize, from: &mut Vec<u32>) -> Vec<u32> {
        (0..n).map(|_| from.swap_remove(self.next(from.len() as u64) as usize)).collect()
    }
}

/// Waits (up to 10 s) until `cond` holds; the data plane is asynchronous.
pub async fn eventually(what: &str, cond: impl Fn() -> bool) {
    for _ in 0..1000 {
        if cond() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("timed out waiting for {what}");
}

pub async fn outcome(rx: tokio::sync::oneshot::Receiver<Outcome>) -> Outcome {
    tokio::time::timeout(Duration::from_secs(10), rx).await.expect("room ended in time").expect("outcome sent")
}
