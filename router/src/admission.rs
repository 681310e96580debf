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

/// A running request's slot, given back when dropped; counted in
/// `ferry_router_running_requests` while it lives.
pub struct Slot {
    _permit: Option<OwnedSemaphorePermit>,
}

impl Slot {
    fn new(permit: Option<OwnedSemaphorePermit>) -> Self {
        metrics::gauge!(M::ROUTER_RUNNING).increment(1.0);
        Self { _permit: permit }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        metrics::gauge!(M::ROUTER_RUNNING).decrement(1.0);
    }
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
        Ok(Slot::new(self.acquire(1).await?))
    }

    /// Waits for `k` slots at once, as [`admit`](Self::admit) for one (a batch of prompts:
    /// one slot each, taken together so that two batches never hold part of what each waits
    /// for). More than `--max-running-requests` can never run: refused as invalid.
    pub async fn admit_many(&self, k: usize) -> Result<Vec<Slot>, RouterError> {
        self.can_run(k)?;
        let Some(mut permit) = self.acquire(k).await? else {
            return Ok((0..k).map(|_| Slot::new(None)).collect());
        };
        let mut slots: Vec<Slot> = (1..k).map(|_| Slot::new(permit.split(1))).collect();
        slots.push(Slot::new(Some(permit)));
        Ok(slots)
    }

    /// `k` permits (at most `max_running`; none when it is 0, no bound).
    async fn acquire(&self, k: usize) -> Result<Option<OwnedSemaphorePermit>, RouterError> {
        if self.limits.max_running == 0 {
            return Ok(None);
        }
        let k = k as u32;
        if let Ok(p) = Arc::clone(&self.slots).try_acquire_many_owned(k) {
            metrics::counter!(M::ROUTER_ADMISSION, "outcome" => "immediate").increment(1);
            return Ok(Some(p));
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
        match tokio::time::timeout(self.limits.timeout, Arc::clone(&self.slots).acquire_many_owned(k)).await {
            Ok(Ok(p)) => {
                metrics::counter!(M::ROUTER_ADMISSION, "outcome" => "queued").increment(1);
                metrics::histogram!(M::ROUTER_QUEUE_SECONDS).record(started.elapsed().as_secs_f64());
                Ok(Some(p))
            }
            Ok(Err(_)) => Err(RouterError::Stopping),
            Err(_) => Err(refused(
                "timeout",
                format!("no capacity within {} ms in the admission queue", self.limits.timeout.as_millis()),
                self.limits.timeout,
            )),
        }
    }

    /// Whether a batch of `k` requests can ever run at once (`--max-running-requests`).
    pub fn can_run(&self, k: usize) -> Result<(), RouterError> {
        let max = self.limits.max_running;
        if max > 0 && k > max {
            let why = format!("{k} prompts in one request; the router runs at most {max} at once");
            return Err(RouterError::invalid("too_many_prompts", why));
        }
        Ok(())
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
    async fn a_batch_takes_its_slots_together_and_gives_them_back_one_by_one() {
        let a = Arc::new(Admission::new(limits(4, 4, 5_000)));
        let held = a.admit().await.expect("a free slot");
        let mut batch = a.admit_many(3).await.expect("three of the four");
        assert_eq!(batch.len(), 3);
        assert!(a.slots.try_acquire().is_err(), "all four taken");
        // A second batch of two waits for two free slots at once.
        let a2 = Arc::clone(&a);
        let second = tokio::spawn(async move { a2.admit_many(2).await.map(|s| s.len()) });
        while a.waiting() == 0 {
            tokio::task::yield_now().await;
        }
        batch.pop();
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!second.is_finished(), "one free slot does not admit a batch of two");
        drop(held);
        assert_eq!(second.await.expect("join").expect("admitted"), 2);
        let e = a.admit_many(5).await.err().expect("more than can ever run");
        assert_eq!(e.status().code(), tonic::Code::InvalidArgument, "{e:?}");
        assert!(e.to_string().contains("5 prompts"), "{e}");
    }

    #[tokio::test]
    async fn no_bound_admits_everything() {
        let a = Admission::new(limits(0, 0, 1));
        let held: Vec<_> = futures::future::join_all((0..100).map(|_| a.admit())).await;
        assert!(held.iter().all(Result::is_ok));
    }
}
