//! A value read by many and written by one at a time, kept in two copies so that a reader
//! never waits for the writer: the writer changes the copy nobody is sent to, then sends
//! readers there, and brings the other copy up to date at its next write (the left-right
//! scheme of the `left-right` crate, whose read handles are per thread; these are not).
//!
//! A write takes operations and applies each to one copy, then the same operations to the
//! other copy one write later: the value must change the same way for the same operations.
//! What the value needs only to make changes (the index: its page table) can be kept once, by
//! the writer: the first making of a change uses it and leaves a trace, from which the second
//! makes the same change without it.
//! Readers share a copy and wait for nobody; the writer waits for the readers still on the
//! copy it is about to change (a read is short), and writers wait for each other.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use parking_lot::{Mutex, RwLock, RwLockReadGuard};

/// A value that changes by operations, the same way each time for the same operations.
pub trait Absorb {
    /// One change.
    type Op;
    /// Why a change could not be made (the value may have taken part of it, the same part in
    /// either copy).
    type Error;
    /// What the writer keeps once for both copies.
    type Side: Default;
    /// What first makings of changes left for the second, in order.
    type Trace: Default;
    /// Makes change `op` with `side`, adding to `trace` what the second making needs.
    fn absorb(&mut self, op: &Self::Op, side: &mut Self::Side, trace: &mut Self::Trace) -> Result<(), Self::Error>;
    /// Makes change `op` again, as `absorb` made it in the other copy from the same state,
    /// taking from `trace` what that left (any error was told then).
    fn absorb_again(&mut self, op: &Self::Op, trace: &mut Self::Trace);
    /// Empties `trace` once the second makings are made; false when they did not take
    /// exactly what the first left (the copies may differ: a bug, counted).
    fn reset(trace: &mut Self::Trace) -> bool {
        *trace = Self::Trace::default();
        true
    }
}

/// What the writer holds: the operations the copy readers are not sent to lacks, and their
/// trace; what it keeps once for both copies.
struct Writer<T: Absorb> {
    behind: Vec<T::Op>,
    trace: T::Trace,
    side: T::Side,
}

/// `T` in two copies: readers on the current one, the writer on the other.
pub struct Published<T: Absorb> {
    copies: [RwLock<T>; 2],
    /// The copy readers are sent to.
    current: AtomicUsize,
    /// Held by the writer.
    writer: Mutex<Writer<T>>,
    /// Writes whose second makings did not take exactly what the first left.
    diverged: AtomicU64,
}

impl<T: Absorb> Published<T> {
    /// `a` and `b`, which must be equal.
    pub fn new(a: T, b: T) -> Self {
        let writer = Writer { behind: Vec::new(), trace: T::Trace::default(), side: T::Side::default() };
        Self {
            copies: [RwLock::new(a), RwLock::new(b)],
            current: AtomicUsize::new(0),
            writer: Mutex::new(writer),
            diverged: AtomicU64::new(0),
        }
    }

    /// What the writer keeps once for both copies, read once no write is being made.
    pub fn side<R>(&self, f: impl FnOnce(&T::Side) -> R) -> R {
        f(&self.writer.lock().side)
    }

    /// Writes whose second makings did not take exactly what the first left (each a bug:
    /// the copies may differ since), counted when the next write makes them.
    pub fn diverged(&self) -> u64 {
        self.diverged.load(Ordering::Relaxed)
    }

    /// The current copy, without waiting for a write: a copy the writer holds, or is waiting
    /// for, is no longer the current one, so a failed attempt finds the other free.
    pub fn read(&self) -> RwLockReadGuard<'_, T> {
        loop {
            if let Some(g) = self.copies[self.current.load(Ordering::Acquire)].try_read() {
                return g;
            }
            std::hint::spin_loop();
        }
    }

    /// When `admit()` (asked with writes shut out) says so, makes the changes `ops`, in order,
    /// and sends readers to them; stops at the first change that fails and returns its error
    /// (what came before it, and its own part, stay made). `Ok(false)`: not admitted.
    pub fn write(&self, ops: impl IntoIterator<Item = T::Op>, admit: impl FnOnce() -> bool) -> Result<bool, T::Error> {
        let mut writer = self.writer.lock();
        if !admit() {
            return Ok(false);
        }
        let other = 1 - self.current.load(Ordering::Acquire);
        let mut copy = self.copies[other].write();
        let Writer { behind, trace, side } = &mut *writer;
        // The last write's changes, made to the current copy then: any error was told then.
        for op in behind.drain(..) {
            copy.absorb_again(&op, trace);
        }
        if !T::reset(trace) {
            self.diverged.fetch_add(1, Ordering::Relaxed);
            tracing::error!("a write's second making did not take what its first left: the copies may differ");
        }
        let mut out = Ok(true);
        for op in ops {
            let made = copy.absorb(&op, side, trace);
            behind.push(op);
            if let Err(e) = made {
                out = Err(e);
                break;
            }
        }
        drop(copy);
        self.current.store(other, Ordering::Release);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::mpsc::{Receiver, Sender, channel};
    use std::time::Duration;

    /// A list that takes numbers; a number sent in with a gate waits for the gate to open
    /// before it goes in (a long write, held as long as a test likes).
    #[derive(Default)]
    struct Log(Vec<u32>);

    /// A number, and maybe a gate: on reaching it the change says so, then waits for it to
    /// open (its sender to go).
    struct Push(u32, Option<(Sender<()>, Receiver<()>)>);

    impl Absorb for Log {
        type Op = Push;
        type Error = u32;
        type Side = ();
        type Trace = ();
        fn absorb(&mut self, op: &Push, _: &mut (), _: &mut ()) -> Result<(), u32> {
            self.push(op)
        }
        fn absorb_again(&mut self, op: &Push, _: &mut ()) {
            let _ = self.push(op);
        }
    }

    impl Log {
        fn push(&mut self, op: &Push) -> Result<(), u32> {
            if let Some((entered, gate)) = &op.1 {
                let _ = entered.send(());
                let _ = gate.recv();
            }
            if op.0 == 13 {
                return Err(13);
            }
            self.0.push(op.0);
            Ok(())
        }
    }

    /// Issue 17: "readers never wait for event ingestion". A reader that came while the writer
    /// was in the middle of a change read the value as it was before it, at once; after the
    /// write it reads the change, and so it does from the other copy after the next write.
    #[test]
    fn a_reader_never_waits_for_a_write() {
        let p = Arc::new(Published::new(Log::default(), Log::default()));
        p.write([Push(1, None)], || true).unwrap_or_else(|_| unreachable!());
        let ((open, gate), (entered, inside)) = (channel(), channel());
        let writer = {
            let p = Arc::clone(&p);
            std::thread::spawn(move || p.write([Push(2, Some((entered, gate))), Push(3, None)], || true).is_ok())
        };
        // The writer is inside its change, holding its copy, until the gate opens. Readers on
        // another thread still answer, with the value before the write.
        inside.recv_timeout(Duration::from_secs(10)).expect("the writer began");
        let (tx, got) = channel();
        let reader = {
            let p = Arc::clone(&p);
            std::thread::spawn(move || {
                for _ in 0..100 {
                    tx.send(p.read().0.clone()).expect("sent");
                    std::thread::sleep(Duration::from_millis(1));
                }
            })
        };
        for _ in 0..100 {
            let seen = got.recv_timeout(Duration::from_secs(10)).expect("a reader waited for the writer");
            assert_eq!(seen, vec![1], "a change half made was seen");
        }
        reader.join().expect("reader");
        // Opened for good: the other copy takes the same change at the next write.
        drop(open);
        assert!(writer.join().expect("writer"));
        assert_eq!(p.read().0, vec![1, 2, 3]);
        // The next write brings the other copy up to date before its own change.
        p.write([Push(4, None)], || true).unwrap_or_else(|_| unreachable!());
        assert_eq!(p.read().0, vec![1, 2, 3, 4]);
        p.write([], || true).unwrap_or_else(|_| unreachable!());
        assert_eq!(p.read().0, vec![1, 2, 3, 4], "both copies took every change once");
    }

    /// A sum whose second makings take the first's trace, one entry each, except for 13,
    /// which takes none (a copy that went its own way).
    #[derive(Default)]
    struct Sum(u32);

    impl Absorb for Sum {
        type Op = u32;
        type Error = ();
        type Side = ();
        type Trace = Vec<u32>;
        fn absorb(&mut self, op: &u32, _: &mut (), trace: &mut Vec<u32>) -> Result<(), ()> {
            trace.push(*op);
            self.0 += op;
            Ok(())
        }
        fn absorb_again(&mut self, op: &u32, trace: &mut Vec<u32>) {
            if *op != 13 {
                trace.remove(0);
            }
            self.0 += op;
        }
        fn reset(trace: &mut Vec<u32>) -> bool {
            let whole = trace.is_empty();
            trace.clear();
            whole
        }
    }

    /// A write whose second making leaves part of the trace is counted (at the next write).
    #[test]
    fn a_second_making_that_strays_is_counted() {
        let p = Published::new(Sum::default(), Sum::default());
        assert_eq!(p.write([1, 2], || true), Ok(true));
        assert_eq!(p.write([], || true), Ok(true));
        assert_eq!(p.diverged(), 0);
        assert_eq!(p.write([13, 4], || true), Ok(true));
        assert_eq!(p.diverged(), 0, "not checked until made again");
        assert_eq!(p.write([], || true), Ok(true));
        assert_eq!(p.diverged(), 1);
        assert_eq!(p.write([5], || true), Ok(true));
        assert_eq!(p.write([], || true), Ok(true));
        assert_eq!(p.diverged(), 1, "only the write that strayed");
    }

    #[test]
    fn a_failed_change_stops_the_write_and_is_made_alike_in_both_copies() {
        let p = Published::new(Log::default(), Log::default());
        assert_eq!(p.write([Push(1, None), Push(13, None), Push(2, None)], || true).err(), Some(13));
        assert_eq!(p.read().0, vec![1]);
        assert_eq!(p.write([Push(5, None)], || false).ok(), Some(false), "not admitted");
        assert_eq!(p.read().0, vec![1]);
        p.write([Push(3, None)], || true).unwrap_or_else(|_| unreachable!());
        p.write([], || true).unwrap_or_else(|_| unreachable!());
        assert_eq!(p.read().0, vec![1, 3]);
    }
}
