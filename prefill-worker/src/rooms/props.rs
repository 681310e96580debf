//! Random event sequences against the room machine (issue 21): whatever arrives — requests
//! and handshakes in either order, duplicates, wrong secrets, aborts, timeouts, room tasks
//! ending, ids reused — every request and handshake handed in comes back exactly once (paired,
//! refused, aborted or timed out: each ends with a reason), an id with a live room task is
//! never paired again, and once every task has reported and every timeout passed the machine
//! holds nothing.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use proptest::prelude::*;

use ferry_cluster::{Room, RoomSecret};

use super::{Action, Event, Phase, PhaseTimeouts, Rooms};

#[derive(Debug, Clone)]
enum Ev {
    Request {
        room: u64,
        good: bool,
    },
    Handshake {
        room: u64,
        good: bool,
    },
    Abort {
        room: u64,
        secret: Option<bool>,
    },
    Computed(u64),
    Progress(u64),
    /// The engine failed a room whose task runs.
    Close(u64),
    /// A room's task reported (only rooms with a task).
    TaskEnded(u64),
    /// The engine hands a room's task pages (a few shared page ids: cached prefixes).
    Handing(u64, Vec<u32>),
    Tick(u64),
}

fn ev() -> impl Strategy<Value = Ev> {
    let room = 0u64..4;
    prop_oneof![
        (room.clone(), proptest::bool::weighted(0.9)).prop_map(|(room, good)| Ev::Request { room, good }),
        (room.clone(), proptest::bool::weighted(0.9)).prop_map(|(room, good)| Ev::Handshake { room, good }),
        (room.clone(), proptest::option::of(any::<bool>())).prop_map(|(room, secret)| Ev::Abort { room, secret }),
        room.clone().prop_map(Ev::Computed),
        room.clone().prop_map(Ev::Progress),
        room.clone().prop_map(Ev::Close),
        room.clone().prop_map(Ev::TaskEnded),
        (room, proptest::collection::vec(0u32..6, 1..4)).prop_map(|(room, pages)| Ev::Handing(room, pages)),
        (0u64..2500).prop_map(Ev::Tick),
    ]
}

fn secret(room: u64, good: bool) -> RoomSecret {
    RoomSecret::from([room as u8 + if good { 1 } else { 100 }; 16])
}

fn id(room: u64) -> Room {
    Room::new(room).expect("63 bits")
}

/// What the machine holds, by payload id.
#[derive(Default)]
struct Model {
    held: HashSet<u32>,
    next: u32,
    /// Rooms whose task runs (paired, not yet reported).
    tasks: HashSet<u64>,
    /// Pages each running task was handed.
    wire: HashMap<u64, Vec<u32>>,
}

impl Model {
    fn give(&mut self) -> u32 {
        self.next += 1;
        self.held.insert(self.next);
        self.next
    }

    fn back(&mut self, x: u32) -> Result<(), TestCaseError> {
        prop_assert!(self.held.remove(&x), "payload {x} came back twice or was never given");
        Ok(())
    }
}

/// A room's task reported: the room hands back its record, once.
fn finished(rooms: &mut Rooms<u32, u32, u32>, m: &mut Model, room: u64, now: Instant) -> Result<(), TestCaseError> {
    let actions = rooms.on(Event::Finished(id(room)), now);
    let [Action::Finished { live: Some(live), .. }] = actions.as_slice() else {
        return Err(TestCaseError::fail(format!("room {room}'s task ended but its record did not come back")));
    };
    m.wire.remove(&room);
    m.back(*live)
}

fn run(events: Vec<Ev>) -> Result<(), TestCaseError> {
    let s = Duration::from_secs(1);
    let mut rooms: Rooms<u32, u32, u32> = Rooms::new(PhaseTimeouts { bootstrap: s, waiting: 2 * s, inflight: 3 * s });
    let mut m = Model::default();
    let mut now = Instant::now();
    for e in events {
        match e {
            Ev::Request { room, good } | Ev::Handshake { room, good } => {
                let x = m.give();
                let is_request = matches!(e, Ev::Request { .. });
                let taken = m.tasks.contains(&room);
                let r = if is_request {
                    rooms.request(id(room), secret(room, good), x, now)
                } else {
                    rooms.handshake(id(room), secret(room, good), x, now)
                };
                match r {
                    Ok(None) => prop_assert!(!taken, "room {room}: its task runs, yet a half was queued"),
                    Ok(Some((a, b))) => {
                        prop_assert!(!taken, "room {room} paired again while its task runs");
                        m.back(a)?;
                        m.back(b)?;
                        m.tasks.insert(room);
                        prop_assert_eq!(rooms.phase(id(room)), Some(Phase::Waiting));
                        // The engine starts it: its record lives in the room until the task
                        // reports.
                        let live = m.give();
                        let handed_back = rooms.on(Event::Started { room: id(room), live }, now);
                        prop_assert!(handed_back.is_empty(), "a waiting room refused its record");
                    }
                    Err((_, back)) => {
                        prop_assert_eq!(back, x, "a refusal hands back what it refused");
                        m.back(back)?;
                    }
                }
            }
            Ev::Abort { room, secret: sec } => {
                if let Ok(Some(gone)) = rooms.abort(id(room), sec.map(|g| secret(room, g)), now) {
                    for x in gone.request.into_iter().chain(gone.handshake) {
                        m.back(x)?;
                    }
                }
            }
            Ev::Computed(room) => rooms.computed(id(room), now),
            Ev::Progress(room) => rooms.progress(id(room), now),
            Ev::Close(room) => {
                if m.tasks.contains(&room) {
                    rooms.close(id(room), Some("failed".into()), now);
                    prop_assert_eq!(rooms.phase(id(room)), Some(Phase::Closing));
                }
            }
            Ev::TaskEnded(room) => {
                if m.tasks.remove(&room) {
                    finished(&mut rooms, &mut m, room, now)?;
                }
            }
            Ev::Handing(room, pages) => {
                let on_wire: HashSet<u32> = m.wire.values().flatten().copied().collect();
                let actions = rooms.on(Event::Handing { room: id(room), pages: pages.clone() }, now);
                if m.tasks.contains(&room) {
                    // Copied to the mirror: exactly the pages no running task has.
                    let fresh: Vec<u32> = pages.iter().copied().filter(|p| !on_wire.contains(p)).collect();
                    let [Action::Mirror { pages: copied }] = actions.as_slice() else {
                        return Err(TestCaseError::fail(format!(
                            "room {room}: handing gave {} actions",
                            actions.len()
                        )));
                    };
                    prop_assert_eq!(copied, &fresh);
                    m.wire.entry(room).or_default().extend(pages);
                } else {
                    prop_assert!(actions.is_empty(), "room {} has no task, yet sends", room);
                }
                let want: HashSet<u32> = m.wire.values().flatten().copied().collect();
                prop_assert_eq!(rooms.pages_on_wire(), want.len());
            }
            Ev::Tick(ms) => {
                now += Duration::from_millis(ms);
                for gone in rooms.expired(now) {
                    for x in gone.request.into_iter().chain(gone.handshake) {
                        m.back(x)?;
                    }
                }
            }
        }
        let (b, w, i) = rooms.depth();
        prop_assert_eq!(b + w + i, rooms.len());
        prop_assert!(rooms.next_deadline().is_none_or(|d| d > now), "a deadline already passed");
    }
    // The end: every timeout passes, every task reports.
    for gone in rooms.expired(now + Duration::from_secs(3600)) {
        for x in gone.request.into_iter().chain(gone.handshake) {
            m.back(x)?;
        }
    }
    for room in std::mem::take(&mut m.tasks) {
        finished(&mut rooms, &mut m, room, now)?;
    }
    prop_assert!(m.held.is_empty(), "never handed back: {:?}", m.held);
    prop_assert!(rooms.is_empty(), "rooms left: {:?}", rooms.depth());
    prop_assert_eq!(rooms.pages_on_wire(), 0, "pages left on the wire");
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn every_request_and_handshake_ends_once_and_ids_stay_taken_while_tasks_run(
        events in proptest::collection::vec(ev(), 1..80),
    ) {
        run(events)?;
    }
}
