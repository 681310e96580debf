//! The engine thread's loop, shared by both daemons: with work to compute it takes the
//! commands that came and goes on; with none it blocks until the next command or the
//! engine's next deadline (an idle engine, or one waiting for transfers, does not wake to
//! poll; `ferry_engine_wakeups_total` counts its wake-ups). After the commands, one
//! [`EngineThread::turn`] (timeouts, admission, a forward pass, publishing); it exits once
//! stopped and holding nothing.

use std::sync::mpsc::{Receiver, RecvTimeoutError, TryRecvError};
use std::time::Instant;

use ferry_cluster::WorkerId;
use ferry_cluster::metrics as m;

/// What a daemon's engine thread does; [`run`] drives it.
pub trait EngineThread {
    /// Its commands.
    type Cmd;
    /// The daemon's role and worker id (metric labels).
    fn labels(&self) -> (&'static str, WorkerId);
    /// Whether a forward pass has work now: the loop does not sleep.
    fn busy(&self) -> bool;
    /// When the next timeout falls: an idle loop sleeps until then at most.
    fn next_deadline(&self) -> Option<Instant>;
    /// One command.
    fn handle(&mut self, c: Self::Cmd);
    /// Every command sender is gone. Returns true when the thread should exit now (while
    /// busy it finishes its turn first).
    fn disconnected(&mut self) -> bool;
    /// After the commands: timeouts, admission, one forward pass, publishing.
    fn turn(&mut self, now: Instant);
    /// Stopped and holding nothing: the thread exits.
    fn finished(&self) -> bool;
}

/// Runs `engine` on its commands until it is [`finished`](EngineThread::finished) (or its
/// senders are gone and it says to exit); returns it.
pub fn run<E: EngineThread>(mut engine: E, rx: Receiver<E::Cmd>) -> E {
    let (role, worker) = engine.labels();
    let wakeups = metrics::counter!(m::ENGINE_WAKEUPS, "role" => role, "worker" => worker);
    loop {
        let first = if engine.busy() {
            match rx.try_recv() {
                Ok(c) => Some(c),
                Err(TryRecvError::Empty) => None,
                Err(TryRecvError::Disconnected) => {
                    engine.disconnected();
                    None
                }
            }
        } else {
            let wait = engine.next_deadline().map(|d| d.saturating_duration_since(Instant::now()));
            match wait.map_or_else(|| rx.recv().map_err(|_| RecvTimeoutError::Disconnected), |w| rx.recv_timeout(w)) {
                Ok(c) => Some(c),
                Err(RecvTimeoutError::Timeout) => None,
                Err(RecvTimeoutError::Disconnected) => {
                    if engine.disconnected() {
                        return engine;
                    }
                    None
                }
            }
        };
        wakeups.increment(1);
        if let Some(c) = first {
            engine.handle(c);
            while let Ok(c) = rx.try_recv() {
                engine.handle(c);
            }
        }
        engine.turn(Instant::now());
        if engine.finished() {
            return engine;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc;
    use std::time::Duration;

    use super::*;

    /// Counts what the loop does; finished once `until` passed (when set) or when stopped.
    #[derive(Default)]
    struct Counting {
        handled: Vec<u32>,
        turns: usize,
        deadline: Option<Instant>,
        stopped: bool,
        busy_turns: usize,
    }

    impl EngineThread for Counting {
        type Cmd = u32;
        fn labels(&self) -> (&'static str, WorkerId) {
            ("test", "loop-test".parse().expect("id"))
        }
        fn busy(&self) -> bool {
            self.busy_turns > 0
        }
        fn next_deadline(&self) -> Option<Instant> {
            self.deadline
        }
        fn handle(&mut self, c: u32) {
            self.handled.push(c);
        }
        fn disconnected(&mut self) -> bool {
            self.stopped = true;
            !self.busy()
        }
        fn turn(&mut self, now: Instant) {
            self.turns += 1;
            self.busy_turns = self.busy_turns.saturating_sub(1);
            if self.deadline.is_some_and(|d| now >= d) {
                self.stopped = true;
            }
        }
        fn finished(&self) -> bool {
            self.stopped && !self.busy()
        }
    }

    /// Runs `engine` on a thread; returns it when the loop ended (within 10 s).
    fn run_to_end(engine: Counting, rx: Receiver<u32>) -> Counting {
        let (done_tx, done_rx) = mpsc::channel();
        std::thread::spawn(move || {
            let _ = done_tx.send(run(engine, rx));
        });
        done_rx.recv_timeout(Duration::from_secs(10)).expect("the loop ended")
    }

    #[test]
    fn an_idle_loop_wakes_only_for_commands_and_exits_when_its_senders_are_gone() {
        let (tx, rx) = mpsc::channel();
        for c in 0..3 {
            tx.send(c).expect("send");
        }
        let sender = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(200));
            tx.send(3).expect("send");
        });
        let e = run_to_end(Counting::default(), rx);
        sender.join().expect("sender");
        assert_eq!(e.handled, vec![0, 1, 2, 3], "every command, in order");
        // One turn for the first three (taken together), one for the late one: no polling
        // while it waited 200 ms.
        assert_eq!(e.turns, 2);
    }

    #[test]
    fn an_idle_loop_wakes_at_its_deadline() {
        let (_tx, rx) = mpsc::channel::<u32>();
        let t0 = Instant::now();
        let e = run_to_end(Counting { deadline: Some(t0 + Duration::from_millis(50)), ..Counting::default() }, rx);
        assert!(t0.elapsed() >= Duration::from_millis(50));
        assert!(e.turns <= 2, "woke {} times for one deadline", e.turns);
    }

    #[test]
    fn a_busy_loop_finishes_its_work_after_its_senders_are_gone() {
        let (tx, rx) = mpsc::channel::<u32>();
        drop(tx);
        let e = run_to_end(Counting { busy_turns: 5, ..Counting::default() }, rx);
        assert_eq!(e.turns, 5, "every busy turn ran before the exit");
    }
}
