//! A busy prefill daemon frozen (SIGSTOP). A frozen process closes nothing: no FIN, no RST,
//! and its kernel still answers TCP. The request it holds must move to another worker while
//! it is still frozen (the router's health checks take it out of placement; failing that, its
//! HTTP/2 pings go unanswered), not wait for it to thaw.
//!
//! A freeze can miss: the request that made the daemon look busy may end in the moment before
//! SIGSTOP lands, and the router may place nothing more on it before it notices. A freeze
//! after which no request was retried and none waits is made again, 3 times at most.

use std::time::{Duration, Instant};

use crate::cluster::Cluster;
use crate::load::Load;

/// Freezes made before giving up on catching a request.
const TRIES: usize = 3;
/// How long a request takes here at most when nothing holds it (e2e max ~3 s in every phase
/// of every run so far), with a margin.
const LONGEST: Duration = Duration::from_secs(8);

/// What the last freeze found.
pub struct Freeze {
    /// The daemon frozen.
    pub name: &'static str,
    /// Whether it was seen holding a request (else the freeze hit an idle daemon).
    pub busy: bool,
    /// Freezes made.
    pub tries: usize,
    /// From SIGSTOP until the router stopped placing on it.
    pub unhealthy: Duration,
    /// From SIGSTOP to SIGCONT.
    pub frozen_for: Duration,
    /// From SIGSTOP until the router retried a prefill call that failed on this daemon (None:
    /// it did not, within 15 s).
    pub moved: Option<Duration>,
    /// Requests sent before the router stopped placing on the daemon and still unanswered
    /// when it thawed, [`LONGEST`] later at least: they waited for it (must be 0).
    pub waited: usize,
}

/// Freezes a busy one of the prefill daemons `names` (indexes as `c.prefill`) until the router
/// retried its request elsewhere and every request that was not held has had time to end, then
/// thaws it and waits for the router to list all of `names` and `decode` again.
pub async fn busy_prefill(c: &Cluster, load: &Load, names: [&'static str; 2], decode: &[&str]) -> Freeze {
    let mut tries = 0;
    loop {
        tries += 1;
        let busy = Cluster::wait_busy(&c.prefill).await;
        let i = busy.unwrap_or(1);
        // Retries of a prefill call that failed on this daemon: a request moved off it (not
        // any retry elsewhere in the cluster).
        let before = c.router_retries_of("prefill", names[i]).await;
        let t = Instant::now();
        c.prefill[i].signal(libc::SIGSTOP);
        let unhealthy = c.wait_members(&[names[1 - i]], decode, Duration::from_secs(20)).await;
        let mut moved = None;
        while moved.is_none() && t.elapsed() < Duration::from_secs(15) {
            if c.router_retries_of("prefill", names[i]).await > before {
                moved = Some(t.elapsed());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        // Frozen until a request placed on the other daemon just before this one was taken
        // out, or the one moved, has had LONGEST to end.
        let until = Duration::from_secs(10).max(unhealthy + LONGEST).max(moved.map_or(Duration::ZERO, |d| d + LONGEST));
        tokio::time::sleep(until.saturating_sub(t.elapsed())).await;
        let waited = load.older_than(t.elapsed().saturating_sub(unhealthy));
        let frozen_for = t.elapsed();
        c.prefill[i].signal(libc::SIGCONT);
        c.wait_members(&names, decode, Duration::from_secs(30)).await;
        let freeze = Freeze { name: names[i], busy: busy.is_some(), tries, unhealthy, frozen_for, moved, waited };
        if moved.is_some() || waited > 0 || busy.is_none() || tries == TRIES {
            return freeze;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}
