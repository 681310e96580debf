//! The room state machine shared by senders and receivers.
//!
//! States only move forward: `Bootstrapping → WaitingForInput → Transferring → Success`
//! (steps may be skipped); `Failed` overrides any state that is not terminal. Every
//! non-terminal state has a timeout — `Transferring` included — checked by [`Progress::tick`]
//! with the caller's clock, so the machine does no I/O and reads no clock itself.

use std::time::{Duration, Instant};

/// Where a room is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum State {
    /// Waiting for the handshake (or for the request, whichever comes second).
    Bootstrapping,
    /// Handshake done; waiting for the first pages (prefill not started or still computing).
    WaitingForInput,
    /// Pages are moving.
    Transferring,
    /// Every page and the aux data arrived.
    Success,
    /// Given up; see [`Progress::reason`].
    Failed,
}

impl State {
    /// Success or Failed.
    pub fn is_terminal(self) -> bool {
        matches!(self, Self::Success | Self::Failed)
    }

    /// Lower-case name, for logs and metric labels.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Bootstrapping => "bootstrapping",
            Self::WaitingForInput => "waiting_for_input",
            Self::Transferring => "transferring",
            Self::Success => "success",
            Self::Failed => "failed",
        }
    }
}

/// Why a room failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FailReason {
    /// The named state lasted longer than its timeout.
    Timeout(State),
    /// Aborted by either side (client cancel, peer shutting down, ...).
    Aborted(String),
    /// A frame failed its checks (checksum, length, bounds).
    Corrupt(String),
    /// The connection to the peer broke.
    PeerGone(String),
    /// The peer refused the room (unknown room, wrong secret, layout mismatch).
    Refused(String),
}

impl FailReason {
    /// A stable label for metrics.
    pub fn label(&self) -> &'static str {
        match self {
            Self::Timeout(_) => "timeout",
            Self::Aborted(_) => "aborted",
            Self::Corrupt(_) => "corrupt",
            Self::PeerGone(_) => "peer_gone",
            Self::Refused(_) => "refused",
        }
    }
}

/// How long each non-terminal state may last.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timeouts {
    /// Bootstrapping.
    pub bootstrap: Duration,
    /// Waiting for input (covers the prefill's queueing and compute).
    pub waiting: Duration,
    /// Transferring, measured from the last progress.
    pub transferring: Duration,
}

impl Default for Timeouts {
    fn default() -> Self {
        Self {
            bootstrap: Duration::from_secs(30),
            waiting: Duration::from_secs(300),
            transferring: Duration::from_secs(30),
        }
    }
}

/// A refused transition.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("room cannot go from {from:?} to {to:?}")]
pub struct BadTransition {
    /// Current state.
    pub from: State,
    /// Requested state.
    pub to: State,
}

/// How far one room's transfer has got, on either side: its state, since when, and why it
/// failed. (The room's id is `ferry_core::Room`.)
#[derive(Debug, Clone)]
pub struct Progress {
    state: State,
    since: Instant,
    reason: Option<FailReason>,
    timeouts: Timeouts,
}

impl Progress {
    /// A room in `Bootstrapping` from `now`.
    pub fn new(now: Instant, timeouts: Timeouts) -> Self {
        Self { state: State::Bootstrapping, since: now, reason: None, timeouts }
    }

    /// The current state.
    pub fn state(&self) -> State {
        self.state
    }

    /// Why the room failed, once it has.
    pub fn reason(&self) -> Option<&FailReason> {
        self.reason.as_ref()
    }

    /// Moves forward to `to` (not to `Failed`: use [`fail`](Self::fail)).
    pub fn advance(&mut self, to: State, now: Instant) -> Result<(), BadTransition> {
        if self.state.is_terminal() || to <= self.state || to == State::Failed {
            return Err(BadTransition { from: self.state, to });
        }
        self.state = to;
        self.since = now;
        Ok(())
    }

    /// Records progress in `Transferring` (restarts its timeout).
    pub fn progress(&mut self, now: Instant) {
        if self.state == State::Transferring {
            self.since = now;
        }
    }

    /// Fails the room; false when it had already ended.
    pub fn fail(&mut self, reason: FailReason) -> bool {
        if self.state.is_terminal() {
            return false;
        }
        self.state = State::Failed;
        self.reason = Some(reason);
        true
    }

    /// When the current state times out (None for terminal states).
    pub fn deadline(&self) -> Option<Instant> {
        let t = match self.state {
            State::Bootstrapping => self.timeouts.bootstrap,
            State::WaitingForInput => self.timeouts.waiting,
            State::Transferring => self.timeouts.transferring,
            State::Success | State::Failed => return None,
        };
        Some(self.since + t)
    }

    /// Fails the room if its state has outlived its timeout; returns the reason when it did.
    pub fn tick(&mut self, now: Instant) -> Option<FailReason> {
        let deadline = self.deadline()?;
        if now < deadline {
            return None;
        }
        let reason = FailReason::Timeout(self.state);
        self.fail(reason.clone());
        Some(reason)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn states_only_move_forward_and_failure_overrides() {
        let t0 = Instant::now();
        let mut r = Progress::new(t0, Timeouts::default());
        assert!(r.advance(State::Transferring, t0).is_ok(), "steps may be skipped");
        assert!(r.advance(State::WaitingForInput, t0).is_err(), "never backwards");
        assert!(r.advance(State::Failed, t0).is_err(), "failure goes through fail()");
        assert!(r.fail(FailReason::Corrupt("crc".into())));
        assert_eq!(r.state(), State::Failed);
        assert!(!r.fail(FailReason::PeerGone("x".into())), "first reason wins");
        assert_eq!(r.reason().map(FailReason::label), Some("corrupt"));
        let mut ok = Progress::new(t0, Timeouts::default());
        assert!(ok.advance(State::Success, t0).is_ok());
        assert!(!ok.fail(FailReason::Aborted("late".into())), "success is final");
    }

    #[test]
    fn every_state_times_out_and_progress_extends_transfers() {
        let t0 = Instant::now();
        let s = Duration::from_secs(1);
        let timeouts = Timeouts { bootstrap: s, waiting: 2 * s, transferring: 3 * s };
        for (state, limit) in [(State::Bootstrapping, s), (State::WaitingForInput, 2 * s), (State::Transferring, 3 * s)]
        {
            let mut r = Progress::new(t0, timeouts);
            if state != State::Bootstrapping {
                r.advance(state, t0).expect("forward");
            }
            assert_eq!(r.tick(t0 + limit - Duration::from_millis(1)), None);
            assert_eq!(r.tick(t0 + limit), Some(FailReason::Timeout(state)));
            assert_eq!(r.state(), State::Failed);
        }
        let mut r = Progress::new(t0, timeouts);
        r.advance(State::Transferring, t0).expect("forward");
        r.progress(t0 + 2 * s);
        assert_eq!(r.tick(t0 + 4 * s), None, "progress restarted the clock");
        assert!(r.tick(t0 + 5 * s).is_some());
        let mut done = Progress::new(t0, timeouts);
        done.advance(State::Success, t0).expect("forward");
        assert_eq!(done.tick(t0 + 100 * s), None);
    }
}
