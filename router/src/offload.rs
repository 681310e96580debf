//! CPU-heavy request work — parsing a body of up to 4 MiB, rendering a chat template,
//! tokenizing a prompt — runs on tokio's blocking threads, at most one job per core at a
//! time, never on the async threads that serve every connection and stream. A bounded number
//! of jobs may wait for a core; past that a request is refused at once ([`Busy`]: 429 or
//! RESOURCE_EXHAUSTED), before any work is done for it. A small body (at most
//! [`INLINE_BYTES`]) is the exception: its work is shorter than the handoff, so it runs where
//! it arrived ([`Pool::run_sized`]).

use std::sync::LazyLock;
use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::sync::Semaphore;

/// Jobs that may wait per core before requests are refused.
pub const WAITING_PER_CORE: usize = 1024;

/// Input bytes that may wait per core before requests are refused: ~0.07 s of tokenizing at
/// the fast path's ~60 M tokens/s on prose (more where few words repeat). The wait a queue means is its work, not its length: 128
/// waiting 16 KB chats are ~2 MB, a few milliseconds.
pub const WAITING_BYTES_PER_CORE: usize = 16 << 20;

/// Bodies up to this size are parsed and tokenized where they arrive: ~20 µs of work at most
/// (the fast tokenizer does ~60 M tokens/s on prose), less than handing the job to a blocking thread
/// and back costs in wakeups and context switches.
pub const INLINE_BYTES: usize = 4096;

/// The pool was full.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the router is busy tokenizing ({0} requests waiting for a core); retry shortly")]
pub struct Busy(pub usize);

/// A bounded pool of blocking jobs.
pub struct Pool {
    permits: Semaphore,
    waiting: AtomicUsize,
    waiting_bytes: AtomicUsize,
    max_waiting: usize,
    max_waiting_bytes: usize,
}

/// Counts a job (and its input bytes) as waiting while it exists (a caller that goes away
/// stops waiting).
struct Waiting<'a> {
    pool: &'a Pool,
    bytes: usize,
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.pool.waiting.fetch_sub(1, Ordering::AcqRel);
        self.pool.waiting_bytes.fetch_sub(self.bytes, Ordering::AcqRel);
    }
}

static GLOBAL: LazyLock<Pool> = LazyLock::new(|| {
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    Pool::new(cores, cores * WAITING_PER_CORE, cores * WAITING_BYTES_PER_CORE)
});

impl Pool {
    /// `workers` jobs at a time; more wait while they are fewer than `max_waiting` and their
    /// inputs ([`run_sized`](Self::run_sized)) come to at most `max_waiting_bytes` (one job
    /// may always wait, whatever its size).
    pub fn new(workers: usize, max_waiting: usize, max_waiting_bytes: usize) -> Self {
        Self {
            permits: Semaphore::new(workers.max(1)),
            waiting: AtomicUsize::new(0),
            waiting_bytes: AtomicUsize::new(0),
            max_waiting,
            max_waiting_bytes,
        }
    }

    /// The process's pool: one job per core; [`WAITING_PER_CORE`] jobs and
    /// [`WAITING_BYTES_PER_CORE`] input bytes waiting per core.
    pub fn global() -> &'static Pool {
        &GLOBAL
    }

    /// Jobs waiting for a core now.
    pub fn waiting(&self) -> usize {
        self.waiting.load(Ordering::Acquire)
    }

    /// [`run`](Self::run), except that a job over an input of at most [`INLINE_BYTES`] runs
    /// here and now (never refused).
    pub async fn run_sized<T: Send + 'static>(
        &self,
        input_bytes: usize,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> Result<T, Busy> {
        if input_bytes <= INLINE_BYTES { Ok(f()) } else { self.queue(input_bytes, f).await }
    }

    /// Runs `f` on a blocking thread once a core is free; [`Busy`] at once when too many
    /// jobs wait already. A panic in `f` is the caller's.
    pub async fn run<T: Send + 'static>(&self, f: impl FnOnce() -> T + Send + 'static) -> Result<T, Busy> {
        self.queue(0, f).await
    }

    async fn queue<T: Send + 'static>(&self, bytes: usize, f: impl FnOnce() -> T + Send + 'static) -> Result<T, Busy> {
        let before = self.waiting.fetch_add(1, Ordering::AcqRel);
        let bytes_before = self.waiting_bytes.fetch_add(bytes, Ordering::AcqRel);
        let queued = Waiting { pool: self, bytes };
        if before >= self.max_waiting || (before > 0 && bytes_before + bytes > self.max_waiting_bytes) {
            return Err(Busy(before));
        }
        // Never closed.
        let permit = self.permits.acquire().await.map_err(|_| Busy(before))?;
        drop(queued);
        let out = tokio::task::spawn_blocking(f).await;
        drop(permit);
        out.map_err(|e| e.try_into_panic().map_or(Busy(0), |p| std::panic::resume_unwind(p)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::time::Duration;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn one_job_per_core_and_a_bounded_queue() {
        let pool = Arc::new(Pool::new(1, 2, usize::MAX));
        let running = Arc::new(AtomicUsize::new(0));
        let most = Arc::new(AtomicUsize::new(0));
        let (go, gate) = std::sync::mpsc::channel::<()>();
        let gate = Arc::new(std::sync::Mutex::new(gate));
        let mut jobs = Vec::new();
        for _ in 0..3 {
            let (pool, running, most, gate) = (pool.clone(), running.clone(), most.clone(), gate.clone());
            jobs.push(tokio::spawn(async move {
                pool.run(move || {
                    let now = running.fetch_add(1, Ordering::SeqCst) + 1;
                    most.fetch_max(now, Ordering::SeqCst);
                    let _ = gate.lock().map(|g| g.recv());
                    running.fetch_sub(1, Ordering::SeqCst);
                })
                .await
            }));
        }
        // One runs, two wait: the queue is full.
        until_waiting(&pool, 2).await;
        assert_eq!(pool.run(|| ()).await, Err(Busy(2)), "refused at once, before any work");
        assert_eq!(pool.run_sized(INLINE_BYTES + 1, || ()).await, Err(Busy(2)), "a large input waits its turn");
        let here = std::thread::current().id();
        let small = pool.run_sized(INLINE_BYTES, move || std::thread::current().id() == here).await;
        assert_eq!(small, Ok(true), "a small input runs at once, on the caller's thread");
        assert_eq!(pool.waiting(), 2, "the refused job does not count");
        for _ in 0..3 {
            go.send(()).expect("release a job");
        }
        for j in jobs {
            assert_eq!(j.await.expect("join"), Ok(()));
        }
        assert_eq!(most.load(Ordering::SeqCst), 1, "never two jobs at once on one core");
        assert_eq!(pool.waiting(), 0);
        assert_eq!(pool.run(|| 7).await, Ok(7));
    }

    /// Waits until `pool` has `n` jobs waiting (up to 10 s on a loaded machine).
    async fn until_waiting(pool: &Pool, n: usize) {
        for _ in 0..2_000 {
            if pool.waiting() == n {
                return;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(pool.waiting(), n);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_queue_is_bounded_by_its_bytes_too() {
        const BIG: usize = INLINE_BYTES + 1_000;
        let pool = Arc::new(Pool::new(1, 100, 2 * BIG));
        let (go, gate) = std::sync::mpsc::channel::<()>();
        let gate = Arc::new(std::sync::Mutex::new(gate));
        let job = |pool: Arc<Pool>, bytes: usize, gate: Arc<std::sync::Mutex<std::sync::mpsc::Receiver<()>>>| {
            tokio::spawn(async move {
                pool.run_sized(bytes, move || {
                    let _ = gate.lock().map(|g| g.recv());
                })
                .await
            })
        };
        // One runs; then one larger than the whole bound still waits (the queue is empty).
        let mut jobs = vec![job(pool.clone(), BIG, gate.clone())];
        for _ in 0..2_000 {
            if pool.permits.available_permits() == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        jobs.push(job(pool.clone(), 10 * BIG, gate.clone()));
        until_waiting(&pool, 1).await;
        assert_eq!(pool.run_sized(BIG, || ()).await, Err(Busy(1)), "past the bytes bound");
        assert_eq!(pool.run(|| ()).await, Err(Busy(1)), "so is any job while more than the bound waits");
        for _ in 0..jobs.len() {
            go.send(()).expect("release a job");
        }
        for j in jobs {
            assert_eq!(j.await.expect("join"), Ok(()));
        }
        assert_eq!(pool.waiting_bytes.load(Ordering::Acquire), 0, "bytes released");
        // Two that fit wait together; a third does not.
        let mut jobs = vec![job(pool.clone(), BIG, gate.clone())];
        for _ in 0..2_000 {
            if pool.permits.available_permits() == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        jobs.push(job(pool.clone(), BIG, gate.clone()));
        jobs.push(job(pool.clone(), BIG, gate.clone()));
        until_waiting(&pool, 2).await;
        assert_eq!(pool.run_sized(BIG, || ()).await, Err(Busy(2)));
        for _ in 0..jobs.len() {
            go.send(()).expect("release a job");
        }
        for j in jobs {
            assert_eq!(j.await.expect("join"), Ok(()));
        }
    }
}
