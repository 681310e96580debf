//! Every event in every state (issue 21; the refusals and a transfer's end since issue 60):
//! one request (room 7: a 4-token prompt that may
//! generate 8, a page per token, 2 tokens reserved) is brought into each state, then each
//! event is applied to a fresh copy; the table says where it ends up and what the engine is
//! told to do. A row that changes is a change of the machine's rules.

use std::time::{Duration, Instant};

use ferry_cluster::Room;

use super::{Action, Admission, Event, Limits, Queues, Stage};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Absent,
    Prealloc,
    Transfer,
    Prefill,
    Waiting,
    Running,
    /// Ended while a write may still land in its pages.
    Draining,
}

const STATES: [State; 7] =
    [State::Absent, State::Prealloc, State::Transfer, State::Prefill, State::Waiting, State::Running, State::Draining];

const EVENTS: [&str; 19] = [
    "request",
    "request_n_over_batch",
    "request_over_pool",
    "request_bad_forks",
    "admit",
    "transfer_ended",
    "transfer_failed",
    "transferred",
    "computed",
    "joined",
    "token",
    "grow_failed",
    "make_room",
    "stepped",
    "end",
    "end_writing",
    "released",
    "tick",
    "tick_late",
];

fn room() -> Room {
    Room::new(7).expect("63 bits")
}

fn event(name: &str) -> Event {
    let room = room();
    match name {
        "request" => Event::Request { room, prompt: 4, limit: 8, local: false, n: 1, forks: 0 },
        // 5 sequences: the node runs 4 at most.
        "request_n_over_batch" => Event::Request { room, prompt: 4, limit: 8, local: false, n: 5, forks: 4 },
        // 104 pages: the pool has 16.
        "request_over_pool" => Event::Request { room, prompt: 4, limit: 100, local: false, n: 1, forks: 0 },
        // 2 sequences and no constraint for the second.
        "request_bad_forks" => Event::Request { room, prompt: 4, limit: 2, local: false, n: 2, forks: 0 },
        "admit" => Event::Admit,
        "transfer_ended" => Event::TransferEnded { room, ok: true },
        "transfer_failed" => Event::TransferEnded { room, ok: false },
        "transferred" => Event::Transferred(room),
        "computed" => Event::Computed(room),
        "joined" => Event::Joined(room),
        "token" => Event::Token(room),
        "grow_failed" => Event::GrowFailed { room, pages: 1 },
        "make_room" => Event::MakeRoom,
        "stepped" => Event::Stepped { decoding: true },
        "end" => Event::End { room, writing: false },
        "end_writing" => Event::End { room, writing: true },
        "released" => Event::Released(room),
        "tick" | "tick_late" => Event::Tick,
        other => panic!("no event {other}"),
    }
}

/// Room 7 in `state`, at `t0`.
fn in_state(state: State, t0: Instant) -> Queues {
    let s = Duration::from_secs(1);
    let limits = Limits {
        max_running: 4,
        prealloc_timeout: s,
        waiting_timeout: 2 * s,
        page_size: 1,
        admission: Admission::Reserved { tokens: 2 },
    };
    let mut q = Queues::new(limits, 16);
    let local = state == State::Prefill;
    let mut go = |ev: Event| {
        q.on(ev, t0);
    };
    if state != State::Absent {
        go(Event::Request { room: room(), prompt: 4, limit: 8, local, n: 1, forks: 0 });
    }
    if matches!(state, State::Transfer | State::Prefill | State::Waiting | State::Running | State::Draining) {
        go(Event::Admit);
    }
    if matches!(state, State::Waiting | State::Running) {
        go(Event::Transferred(room()));
    }
    if state == State::Running {
        go(Event::Joined(room()));
        go(Event::Token(room()));
    }
    if state == State::Draining {
        go(Event::End { room: room(), writing: true });
    }
    assert_eq!(observe(&q), state, "fixture");
    q
}

fn observe(q: &Queues) -> State {
    match q.stage(room()) {
        None if q.is_draining(room()) => State::Draining,
        None => State::Absent,
        Some(Stage::Prealloc) => State::Prealloc,
        Some(Stage::Transfer) => State::Transfer,
        Some(Stage::Prefill) => State::Prefill,
        Some(Stage::Waiting) => State::Waiting,
        Some(Stage::Running) => State::Running,
    }
}

fn summary(actions: &[Action]) -> String {
    let one = |a: &Action| match a {
        Action::Refuse(r) => format!("refuse {}", r.label()),
        Action::Allocate { pages, local, .. } => format!("allocate {pages}{}", if *local { " local" } else { "" }),
        Action::Grow { pages, .. } => format!("grow {pages}"),
        Action::Retract { pages, context, .. } => format!("retract {pages} {context}"),
        Action::Free { pages, .. } => format!("free {pages}"),
        Action::Drain { pages, .. } => format!("drain {pages}"),
        Action::Expired { stage, .. } => format!("expired {}", stage.label()),
        Action::Land(_) => "land".into(),
        Action::Fail(_) => "fail".into(),
    };
    actions.iter().map(one).collect::<Vec<_>>().join(", ")
}

/// `(state, [(next state, actions)] in the order of EVENTS)`.
#[rustfmt::skip]
fn table() -> Vec<(State, [(State, &'static str); 19])> {
    use State::*;
    let dup = "refuse duplicate_room";
    let (nb, op, bf) = ("refuse n_over_batch", "refuse request_over_pool", "refuse fork_constraints");
    vec![
        //          request          n_over_batch    over_pool       bad_forks       admit                  transfer_ended      transfer_failed     transferred     computed        joined          token           grow_failed     make_room           stepped         end                 end_writing            released          tick            tick_late
        (Absent,   [(Prealloc, ""),  (Absent, nb),   (Absent, op),   (Absent, bf),   (Absent, ""),          (Absent, ""),       (Absent, ""),       (Absent, ""),   (Absent, ""),   (Absent, ""),   (Absent, ""),   (Absent, ""),   (Absent, ""),       (Absent, ""),   (Absent, ""),       (Absent, ""),          (Absent, ""),     (Absent, ""),   (Absent, "")]),
        (Prealloc, [(Prealloc, dup), (Prealloc, nb), (Prealloc, op), (Prealloc, bf), (Transfer, "allocate 4"), (Prealloc, ""),   (Prealloc, ""),     (Prealloc, ""), (Prealloc, ""), (Prealloc, ""), (Prealloc, ""), (Prealloc, ""), (Prealloc, ""),     (Prealloc, ""), (Absent, ""),       (Absent, ""),          (Prealloc, ""),   (Prealloc, ""), (Prealloc, "expired prealloc")]),
        (Transfer, [(Transfer, dup), (Transfer, nb), (Transfer, op), (Transfer, bf), (Transfer, ""),        (Transfer, "land"), (Transfer, "fail"), (Waiting, ""),  (Transfer, ""), (Transfer, ""), (Transfer, ""), (Transfer, ""), (Transfer, ""),     (Transfer, ""), (Absent, "free 4"), (Draining, "drain 4"), (Transfer, ""),   (Transfer, ""), (Transfer, "")]),
        (Prefill,  [(Prefill, dup),  (Prefill, nb),  (Prefill, op),  (Prefill, bf),  (Prefill, ""),         (Prefill, ""),      (Prefill, ""),      (Prefill, ""),  (Running, ""),  (Prefill, ""),  (Prefill, ""),  (Prefill, ""),  (Prefill, ""),      (Prefill, ""),  (Absent, "free 4"), (Draining, "drain 4"), (Prefill, ""),    (Prefill, ""),  (Prefill, "")]),
        (Waiting,  [(Waiting, dup),  (Waiting, nb),  (Waiting, op),  (Waiting, bf),  (Waiting, ""),         (Waiting, ""),      (Waiting, ""),      (Waiting, ""),  (Waiting, ""),  (Running, ""),  (Waiting, ""),  (Waiting, ""),  (Waiting, ""),      (Waiting, ""),  (Absent, "free 4"), (Draining, "drain 4"), (Waiting, ""),    (Waiting, ""),  (Waiting, "expired waiting")]),
        (Running,  [(Running, dup),  (Running, nb),  (Running, op),  (Running, bf),  (Running, ""),         (Running, ""),      (Running, ""),      (Running, ""),  (Running, ""),  (Running, ""),  (Running, ""),  (Running, ""),  (Running, "grow 1"), (Running, ""), (Absent, "free 4"), (Draining, "drain 4"), (Running, ""),    (Running, ""),  (Running, "")]),
        (Draining, [(Draining, "refuse room_closing"), (Draining, nb), (Draining, op), (Draining, bf), (Draining, ""), (Draining, ""), (Draining, ""), (Draining, ""), (Draining, ""), (Draining, ""), (Draining, ""), (Draining, ""), (Draining, ""), (Draining, ""), (Draining, ""), (Draining, ""), (Absent, "free 4"), (Draining, ""), (Draining, "")]),
    ]
}

#[test]
fn every_event_in_every_state() {
    let rows = table();
    assert_eq!(rows.iter().map(|r| r.0).collect::<Vec<_>>(), STATES, "a row per state");
    let t0 = Instant::now();
    let mut wrong = Vec::new();
    for (state, cells) in rows {
        for (name, (next, actions)) in EVENTS.iter().zip(cells) {
            let mut q = in_state(state, t0);
            // "tick" comes before any timeout, "tick_late" after all of them.
            let at = if *name == "tick_late" { t0 + Duration::from_secs(10) } else { t0 };
            let got = summary(&q.on(event(name), at));
            let now = observe(&q);
            if (now, got.as_str()) != (next, actions) {
                wrong.push(format!(
                    "{state:?} × {name}: got ({now:?}, {got:?}), the table says ({next:?}, {actions:?})"
                ));
            }
            // Whatever happened, the pages add up.
            assert_eq!(q.free_pages() + q.held(room()) + q.draining(), 16, "{state:?} × {name}");
        }
    }
    assert!(wrong.is_empty(), "{} cells differ:\n{}", wrong.len(), wrong.join("\n"));
}

/// The cell `Running × make_room` with a pool too short for every running request: the
/// victim (least progress, then newest) is retracted, the other grows.
#[test]
fn a_short_pool_retracts_the_victim_and_grows_the_rest() {
    let t0 = Instant::now();
    let s = Duration::from_secs(1);
    let limits = Limits {
        max_running: 4,
        prealloc_timeout: s,
        waiting_timeout: s,
        page_size: 1,
        admission: Admission::Reserved { tokens: 0 },
    };
    let mut q = Queues::new(limits, 10);
    let (a, b) = (Room::new(1).expect("id"), Room::new(2).expect("id"));
    for r in [a, b] {
        // 4 + 6 = 10 pages each: each fits the pool alone, not both.
        assert!(q.on(Event::Request { room: r, prompt: 4, limit: 6, local: true, n: 1, forks: 0 }, t0).is_empty());
    }
    assert_eq!(summary(&q.on(Event::Admit, t0)), "allocate 4 local, allocate 4 local");
    for r in [a, b] {
        q.on(Event::Computed(r), t0);
        q.on(Event::Token(r), t0);
    }
    assert_eq!(q.on(Event::MakeRoom, t0), vec![Action::Grow { room: a, pages: 1 }, Action::Grow { room: b, pages: 1 }]);
    for r in [a, b] {
        q.on(Event::Token(r), t0);
    }
    // Each needs a 6th page, none is free: room 2 (as far along, newer) goes.
    assert_eq!(
        q.on(Event::MakeRoom, t0),
        vec![Action::Retract { room: b, pages: 5, context: 5, running: true }, Action::Grow { room: a, pages: 1 }]
    );
    assert_eq!((q.stage(b), q.free_pages()), (Some(Stage::Prealloc), 4));
    // It comes back first, to recompute its prompt and its first token.
    assert!(q.on(Event::Admit, t0).is_empty(), "5 pages needed, 4 free");
    assert_eq!(q.on(Event::End { room: a, writing: false }, t0), vec![Action::Free { room: a, pages: 6 }]);
    assert_eq!(q.on(Event::Admit, t0), vec![Action::Allocate { room: b, pages: 5, local: true }]);
}
