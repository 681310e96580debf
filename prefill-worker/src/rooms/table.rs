//! Every event in every phase (issue 21): one room (id 7) is brought into each state, then
//! each event is applied to a fresh copy; the table says where it ends up and what the engine
//! is told to do. A row that changes is a change of the machine's rules.

use std::time::{Duration, Instant};

use ferry_cluster::{Room, RoomSecret};

use super::{Action, Event, Phase, PhaseTimeouts, Rooms};

/// The request's and the handshake's payloads: what they are is all the table needs.
type Table = Rooms<&'static str, &'static str>;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Absent,
    /// Bootstrapping with the request only.
    WithRequest,
    /// Bootstrapping with the handshake only.
    WithHandshake,
    Waiting,
    Inflight,
    Closing,
}

const STATES: [State; 6] =
    [State::Absent, State::WithRequest, State::WithHandshake, State::Waiting, State::Inflight, State::Closing];

const EVENTS: [&str; 17] = [
    "request",
    "request_wrong",
    "handshake",
    "handshake_wrong",
    "abort",
    "abort_wrong",
    "abort_worker",
    "started",
    "handing",
    "computed",
    "progress",
    "close",
    "finished",
    "tick",
    "tick_late",
    "tick_waiting",
    "tick_inflight",
];

fn room() -> Room {
    Room::new(7).expect("63 bits")
}

fn secret(good: bool) -> RoomSecret {
    RoomSecret::from([if good { 7 } else { 9 }; 16])
}

fn event(name: &str) -> Event<&'static str, &'static str> {
    let room = room();
    match name {
        "request" => Event::Request { room, secret: secret(true), request: "request" },
        "request_wrong" => Event::Request { room, secret: secret(false), request: "request" },
        "handshake" => Event::Handshake { room, secret: secret(true), handshake: "handshake" },
        "handshake_wrong" => Event::Handshake { room, secret: secret(false), handshake: "handshake" },
        "abort" => Event::Abort { room, secret: Some(secret(true)) },
        "abort_wrong" => Event::Abort { room, secret: Some(secret(false)) },
        "abort_worker" => Event::Abort { room, secret: None },
        "started" => Event::Started { room, live: () },
        "handing" => Event::Handing { room, pages: vec![3, 4] },
        "computed" => Event::Computed(room),
        "progress" => Event::Progress(room),
        "close" => Event::Close { room, why: "failed".into() },
        "finished" => Event::Finished(room),
        _ if name.starts_with("tick") => Event::Tick,
        other => panic!("no event {other}"),
    }
}

/// When a tick event happens: before any timeout; past the bootstrap timeout (1 s) only; past
/// the waiting one (2 s); past every one.
fn at(name: &str, t0: Instant) -> Instant {
    let ms = match name {
        "tick_waiting" => 1_500,
        "tick_inflight" => 2_500,
        "tick_late" => 10_000,
        _ => 0,
    };
    t0 + Duration::from_millis(ms)
}

fn in_state(state: State, t0: Instant) -> Table {
    let s = Duration::from_secs(1);
    let mut r = Rooms::new(PhaseTimeouts { bootstrap: s, waiting: 2 * s, inflight: 3 * s });
    let mut go = |name: &str| {
        r.on(event(name), t0);
    };
    match state {
        State::Absent => {}
        State::WithRequest => go("request"),
        State::WithHandshake => go("handshake"),
        State::Waiting => ["request", "handshake"].into_iter().for_each(go),
        State::Inflight => ["request", "handshake", "computed"].into_iter().for_each(go),
        State::Closing => ["request", "handshake", "close"].into_iter().for_each(go),
    }
    assert_eq!(observe(&r), state, "fixture");
    r
}

fn observe(r: &Table) -> State {
    match r.phase(room()) {
        None => State::Absent,
        Some(Phase::Bootstrap) => match r.slots[&room()].request {
            Some(_) => State::WithRequest,
            None => State::WithHandshake,
        },
        Some(Phase::Waiting) => State::Waiting,
        Some(Phase::Inflight) => State::Inflight,
        Some(Phase::Closing) => State::Closing,
    }
}

fn summary(actions: Vec<Action<&'static str, &'static str>>) -> String {
    let one = |a: Action<&'static str, &'static str>| match a {
        Action::RefuseRequest { why, .. } => format!("refuse request {}", why.label()),
        Action::RefuseHandshake { why, .. } => format!("refuse handshake {}", why.label()),
        Action::Pair { .. } => "pair".to_string(),
        Action::Aborted(Ok(known)) => format!("aborted {known}"),
        Action::Aborted(Err(why)) => format!("aborted {}", why.label()),
        Action::Mirror { pages } => format!("mirror {pages:?}"),
        Action::Finished { live, closed, .. } => format!(
            "finished{}{}",
            if live.is_some() { " (record)" } else { "" },
            closed.as_ref().map_or(String::new(), |why| format!(" closed: {why}"))
        ),
        Action::Gone(g) => {
            let held: Vec<&str> = g.request.into_iter().chain(g.handshake).collect();
            format!("gone {} ({})", g.phase.label(), held.join(" "))
        }
    };
    actions.into_iter().map(one).collect::<Vec<_>>().join(", ")
}

/// Rows in the order of STATES, cells in the order of EVENTS: request, request_wrong,
/// handshake, handshake_wrong, abort, abort_wrong, abort_worker, started, handing, computed, progress,
/// close, finished, tick, tick_late, tick_waiting, tick_inflight.
#[rustfmt::skip]
fn table() -> Vec<[(State, &'static str); 17]> {
    use State::*;
    let (dup, duph) = ("refuse request duplicate_room", "refuse handshake duplicate_handshake");
    let (wrong, wrongh) = ("refuse request wrong_secret", "refuse handshake wrong_secret");
    let back = "finished (record)";
    let (gone_r, gone_h) = ("gone bootstrap (request)", "gone bootstrap (handshake)");
    vec![
        // Absent: a request or handshake, whatever its secret, opens a room with that secret.
        [(WithRequest, ""), (WithRequest, ""), (WithHandshake, ""), (WithHandshake, ""),
         (Absent, "aborted false"), (Absent, "aborted false"), (Absent, "aborted false"),
         (Absent, back), (Absent, ""), (Absent, ""), (Absent, ""), (Absent, ""), (Absent, ""),
         (Absent, ""), (Absent, ""), (Absent, ""), (Absent, "")],
        // Bootstrapping with the request: closing it hands the request back; a task's report
        // means nothing (it has no task).
        [(WithRequest, dup), (WithRequest, wrong), (Waiting, "pair"), (WithRequest, wrongh),
         (Absent, "aborted true, gone bootstrap (request)"), (WithRequest, "aborted wrong_secret"),
         (Absent, "aborted true, gone bootstrap (request)"),
         (WithRequest, back), (WithRequest, ""), (WithRequest, ""), (WithRequest, ""), (Absent, gone_r), (WithRequest, ""),
         (WithRequest, ""), (Absent, gone_r), (Absent, gone_r), (Absent, gone_r)],
        [(Waiting, "pair"), (WithHandshake, wrong), (WithHandshake, duph), (WithHandshake, wrongh),
         (Absent, "aborted true, gone bootstrap (handshake)"), (WithHandshake, "aborted wrong_secret"),
         (Absent, "aborted true, gone bootstrap (handshake)"),
         (WithHandshake, back), (WithHandshake, ""), (WithHandshake, ""), (WithHandshake, ""), (Absent, gone_h), (WithHandshake, ""),
         (WithHandshake, ""), (Absent, gone_h), (Absent, gone_h), (Absent, gone_h)],
        // Waiting: the engine's record is taken (started); the task's report hands it back.
        [(Waiting, dup), (Waiting, wrong), (Waiting, duph), (Waiting, wrongh),
         (Closing, "aborted true, gone waiting ()"), (Waiting, "aborted wrong_secret"),
         (Closing, "aborted true, gone waiting ()"),
         (Waiting, ""), (Waiting, "mirror [3, 4]"), (Inflight, ""), (Waiting, ""), (Closing, ""), (Absent, "finished"),
         (Waiting, ""), (Closing, "gone waiting ()"), (Waiting, ""), (Closing, "gone waiting ()")],
        [(Inflight, dup), (Inflight, wrong), (Inflight, duph), (Inflight, wrongh),
         (Closing, "aborted true, gone inflight ()"), (Inflight, "aborted wrong_secret"),
         (Closing, "aborted true, gone inflight ()"),
         (Inflight, back), (Inflight, "mirror [3, 4]"), (Inflight, ""), (Inflight, ""), (Closing, ""), (Absent, "finished"),
         (Inflight, ""), (Closing, "gone inflight ()"), (Inflight, ""), (Inflight, "")],
        // Closing: the id stays taken until the task reports, which hands back why it closed;
        // no timeout here.
        [(Closing, "refuse request room_closing"), (Closing, wrong), (Closing, "refuse handshake room_closing"),
         (Closing, wrongh), (Closing, "aborted false"), (Closing, "aborted wrong_secret"), (Closing, "aborted false"),
         (Closing, back), (Closing, "mirror [3, 4]"), (Closing, ""), (Closing, ""), (Closing, ""), (Absent, "finished closed: failed"),
         (Closing, ""), (Closing, ""), (Closing, ""), (Closing, "")],
    ]
}

#[test]
fn every_event_in_every_phase() {
    let rows = table();
    assert_eq!(rows.len(), STATES.len(), "a row per state");
    let t0 = Instant::now();
    let mut wrong = Vec::new();
    for (state, cells) in STATES.into_iter().zip(rows) {
        for (name, (next, actions)) in EVENTS.iter().zip(cells) {
            let mut r = in_state(state, t0);
            let got = summary(r.on(event(name), at(name, t0)));
            let now = observe(&r);
            if (now, got.as_str()) != (next, actions) {
                wrong.push(format!(
                    "{state:?} × {name}: got ({now:?}, {got:?}), the table says ({next:?}, {actions:?})"
                ));
            }
        }
    }
    assert!(wrong.is_empty(), "{} cells differ:\n{}", wrong.len(), wrong.join("\n"));
}
