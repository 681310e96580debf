//! The router's admission control: at most `max_running` requests run at once; up to
//! `max_queued` more wait, each for at most `timeout`; the rest are refused at once. A refused
//! or timed-out request gets a retriable status (`RESOURCE_EXHAUSTED` with a `retry-after-ms`
//! hint, HTTP 429) instead of piling up work the cluster cannot do in time.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use crate::error::RouterError;
use ferry_cluster::metrics as M;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Bounds on running and waiting requests.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Requests running at once (0: no bound).
    pub max_running: usize,
    /// Requests waiting for a slot beyond those.
    pub max_queued: usize,
    /// How long one request waits at most.
    pub timeout: Duration,
}

/// The admission queue.
pub struct Admission {
    limits: Limits,
    slots: Arc<Semaphore>,
    waiting: AtomicUsize,
}

/// A running request's slot, given back when dropped.
pub struct Slot {
    _permit: Option<OwnedSemaphorePermit>,
}

/// Counts one waiting request while it waits.
struct Waiting<'a>(&'a AtomicUsize);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        let n = self.0.fetch_sub(1, Ordering::SeqCst) - 1;
        metrics::gauge!(M::ROUTER_QUEUED).set(n as f64);
    }
}

fn refused(reason: &'static str, message: String, retry_after: Duration) -> RouterError {
    metrics::counter!(M::ROUTER_ADMISSION, "outcome" => reason).increment(1);
    metrics::counter!(M::ROUTER_REQUESTS, "outcome" => "refused").increment(1);
    RouterError::Busy { reason, message, retry_after }
}

impl Admission {
    /// An admission queue with these limits.
    pub fn new(limits: Limits) -> Self {
        let n = if limits.max_running == 0 { Semaphore::MAX_PERMITS } else { limits.max_running };
        Self { limits, slots: Arc::new(Semaphore::new(n)), waiting: AtomicUsize::new(0) }
    }

    /// Waits for a slot: immediately when one is free, else in the queue for at most the
    /// timeout; refuses when the queue is full or the wait times out.
    pub async fn admit(&self) -> Result<Slot, RouterError> {
        if self.limits.max_running == 0 {
            return Ok(Slot { _permit: None });
        }
        if let Ok(p) = Arc::clone(&self.slots).try_acquire_owned() {
            metrics::counter!(M::ROUTER_ADMISSION, "outcome" => "immediate").increment(1);
            return Ok(Slot { _permit: Some(p) });
        }
        let before = self.waiting.fetch_add(1, Ordering::SeqCst);
        let _w = Waiting(&self.waiting);
        if before >= self.limits.max_queued {
            return Err(refused(
                "queue_full",
                format!(
                    "the router is at capacity: {} requests running and {} waiting",
                    self.limits.max_running, self.limits.max_queued
                ),
                self.limits.timeout,
            ));
        }
        metrics::gauge!(M::ROUTER_QUEUED).set((before + 1) as f64);
        let started = Instant::now();
        match tokio::time::timeout(self.limits.timeout, Arc::clone(&self.slots).acquire_owned()).await {
            Ok(Ok(p)) => {
                metrics::counter!(M::ROUTER_ADMISSION, "outcome" => "queued").increment(1);
                metrics::histogram!(M::ROUTER_QUEUE_SECONDS).record(started.elapsed().as_secs_f64());
                Ok(Slot { _permit: Some(p) })
            }
            Ok(Err(_)) => Err(RouterError::Stopping),
            Err(_) => Err(refused(
                "timeout",
                format!("no capacity within {} ms in the admission queue", self.limits.timeout.as_millis()),
                self.limits.timeout,
            )),
        }
    }

    /// Requests waiting now.
    pub fn waiting(&self) -> usize {
        self.waiting.load(Ordering::SeqCst)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(running: usize, queued: usize, ms: u64) -> Limits {
        Limits { max_running: running, max_queued: queued, timeout: Duration::from_millis(ms) }
    }

    #[tokio::test]
    async fn a_full_queue_refuses_at_once_and_a_freed_slot_admits_the_next() {
        let a = Arc::new(Admission::new(limits(1, 1, 5_000)));
        let first = a.admit().await.expect("a free slot");
        let a2 = Arc::clone(&a);
        let second = tokio::spawn(async move { a2.admit().await.map(|_| ()) });
        while a.waiting() == 0 {
            tokio::task::yield_now().await;
        }
        let third = a.admit().await.err().expect("the queue is full").status();
        assert_eq!(third.code(), tonic::Code::ResourceExhausted);
        assert!(third.message().contains("at capacity"), "{third:?}");
        assert!(third.metadata().get("retry-after-ms").is_some());
        drop(first);
        second.await.expect("join").expect("admitted once the slot is free");
        assert_eq!(a.waiting(), 0);
    }

    #[tokio::test]
    async fn a_wait_past_the_timeout_is_refused() {
        let a = Admission::new(limits(1, 4, 50));
        let _held = a.admit().await.expect("a free slot");
        let t = Instant::now();
        let e = a.admit().await.err().expect("times out");
        assert!(t.elapsed() >= Duration::from_millis(50));
        assert!(e.to_string().contains("admission queue"), "{e:?}");
        assert_eq!(a.waiting(), 0, "a timed-out request leaves the queue");
    }

    #[tokio::test]
    async fn no_bound_admits_everything() {
        let a = Admission::new(limits(0, 0, 1));
        let held: Vec<_> = futures::future::join_all((0..100).map(|_| a.admit())).await;
        assert!(held.iter().all(Result::is_ok));
    }
}
