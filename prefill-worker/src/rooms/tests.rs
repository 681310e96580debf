//! The room machine's rules, one by one.

use super::*;

fn rooms() -> Rooms<&'static str, &'static str> {
    let s = Duration::from_secs(1);
    Rooms::new(PhaseTimeouts { bootstrap: s, waiting: 2 * s, inflight: 3 * s })
}

#[test]
fn either_half_may_come_first_and_pairs_once() {
    let t0 = Instant::now();
    let mut r = rooms();
    assert_eq!(r.request(Room::from(1u32), RoomSecret::from([1; 16]), "req", t0).ok(), Some(None));
    assert_eq!(r.phase(Room::from(1u32)), Some(Phase::Bootstrap));
    assert_eq!(r.handshake(Room::from(1u32), RoomSecret::from([1; 16]), "hs", t0).ok(), Some(Some(("req", "hs"))));
    assert_eq!(r.phase(Room::from(1u32)), Some(Phase::Waiting));
    assert_eq!(r.handshake(Room::from(2u32), RoomSecret::from([2; 16]), "hs", t0).ok(), Some(None));
    assert_eq!(r.request(Room::from(2u32), RoomSecret::from([2; 16]), "req", t0).ok(), Some(Some(("req", "hs"))));
    assert_eq!(r.depth(), (0, 2, 0));
    r.computed(Room::from(1u32), t0);
    assert_eq!(r.depth(), (0, 1, 1));
    assert_eq!(r.phase(Room::from(1u32)), Some(Phase::Inflight));
    r.on(Event::Finished(Room::from(1u32)), t0);
    assert_eq!(r.len(), 1);
}

#[test]
fn duplicates_and_wrong_secrets_are_refused_without_harm() {
    let t0 = Instant::now();
    let mut r = rooms();
    r.request(Room::from(1u32), RoomSecret::from([1; 16]), "req", t0).expect("first");
    let (e, back) = r.request(Room::from(1u32), RoomSecret::from([1; 16]), "again", t0).expect_err("duplicate");
    assert_eq!((e, back), (Refusal::DuplicateRoom, "again"));
    let (e, _) = r.handshake(Room::from(1u32), RoomSecret::from([9; 16]), "hs", t0).expect_err("wrong secret");
    assert_eq!(e, Refusal::WrongSecret);
    assert!(r.abort(Room::from(1u32), Some(RoomSecret::from([9; 16])), t0).is_err(), "an abort needs the secret");
    assert_eq!(r.phase(Room::from(1u32)), Some(Phase::Bootstrap), "the room is untouched");
    let gone = r.abort(Room::from(1u32), Some(RoomSecret::from([1; 16])), t0).expect("abort").expect("was known");
    assert_eq!((gone.phase, gone.request), (Phase::Bootstrap, Some("req")));
    assert!(r.abort(Room::from(1u32), None, t0).expect("unknown is fine").is_none());
}

/// Issue 21's room-id reuse: an aborted room whose task still runs keeps its id, so a
/// new request or handshake with that id is refused until the task reports, instead of
/// replacing the room the engine is still computing and sending.
#[test]
fn a_room_id_stays_taken_until_the_aborted_rooms_task_reports() {
    let t0 = Instant::now();
    let mut r = rooms();
    r.request(Room::from(1u32), RoomSecret::from([1; 16]), "req", t0).expect("request");
    assert!(
        r.handshake(Room::from(1u32), RoomSecret::from([1; 16]), "hs", t0).expect("handshake").is_some(),
        "paired: the room task starts"
    );
    let gone = r.abort(Room::from(1u32), Some(RoomSecret::from([1; 16])), t0).expect("abort").expect("was known");
    assert_eq!(gone.phase, Phase::Waiting);
    assert_eq!(r.phase(Room::from(1u32)), Some(Phase::Closing));
    let (e, _) =
        r.request(Room::from(1u32), RoomSecret::from([1; 16]), "again", t0).expect_err("the id is still taken");
    assert_eq!(e, Refusal::RoomClosing);
    let (e, _) = r.handshake(Room::from(1u32), RoomSecret::from([1; 16]), "again", t0).expect_err("for handshakes too");
    assert_eq!(e, Refusal::RoomClosing);
    assert!(r.abort(Room::from(1u32), None, t0).expect("closing").is_none(), "not aborted twice");
    assert!(r.expired(t0 + Duration::from_secs(3600)).is_empty(), "closing waits for its task");
    assert_eq!(r.depth(), (0, 0, 1));
    assert_eq!(r.phase(Room::from(1u32)), Some(Phase::Closing));
    r.on(Event::Finished(Room::from(1u32)), t0);
    assert!(r.request(Room::from(1u32), RoomSecret::from([1; 16]), "new", t0).is_ok(), "free once the task reported");
}

/// Issue 21's defect 6: the inflight timeout counted from the end of computation, so a
/// transfer still moving was cut after it.
#[test]
fn an_inflight_room_times_out_from_its_last_progress() {
    let t0 = Instant::now();
    let s = Duration::from_secs(1);
    let mut r = rooms();
    r.request(Room::from(1u32), RoomSecret::from([1; 16]), "a", t0).expect("ok");
    r.handshake(Room::from(1u32), RoomSecret::from([1; 16]), "a", t0).expect("ok");
    r.computed(Room::from(1u32), t0);
    r.progress(Room::from(1u32), t0 + 2 * s);
    assert!(r.expired(t0 + 4 * s).is_empty(), "moving 2 s ago, timeout 3 s");
    assert_eq!(r.expired(t0 + 5 * s).len(), 1);
}

#[test]
fn every_phase_times_out() {
    let t0 = Instant::now();
    let s = Duration::from_secs(1);
    let mut r = rooms();
    r.request(Room::from(1u32), RoomSecret::from([1; 16]), "a", t0).expect("ok");
    r.request(Room::from(2u32), RoomSecret::from([2; 16]), "b", t0).expect("ok");
    r.handshake(Room::from(2u32), RoomSecret::from([2; 16]), "b", t0).expect("ok");
    r.request(Room::from(3u32), RoomSecret::from([3; 16]), "c", t0).expect("ok");
    r.handshake(Room::from(3u32), RoomSecret::from([3; 16]), "c", t0).expect("ok");
    r.computed(Room::from(3u32), t0);
    assert_eq!(r.next_deadline(), Some(t0 + s));
    assert!(r.expired(t0 + s - Duration::from_millis(1)).is_empty());
    let e = r.expired(t0 + s);
    assert_eq!(r.next_deadline(), Some(t0 + 2 * s), "the first deadline left is room 2's");
    assert_eq!((e.len(), e[0].room, e[0].phase, e[0].request), (1, Room::from(1u32), Phase::Bootstrap, Some("a")));
    assert_eq!(
        r.expired(t0 + 2 * s).iter().map(|e| (e.room, e.phase)).collect::<Vec<_>>(),
        vec![(Room::from(2u32), Phase::Waiting)]
    );
    assert_eq!(
        r.expired(t0 + 3 * s).iter().map(|e| (e.room, e.phase)).collect::<Vec<_>>(),
        vec![(Room::from(3u32), Phase::Inflight)]
    );
    // Rooms 2 and 3 had tasks: closing until they report.
    assert_eq!((r.phase(Room::from(2u32)), r.phase(Room::from(3u32))), (Some(Phase::Closing), Some(Phase::Closing)));
    assert_eq!(r.next_deadline(), None, "closing rooms wait for their tasks, not a clock");
    r.on(Event::Finished(Room::from(2u32)), t0);
    r.on(Event::Finished(Room::from(3u32)), t0);
    assert!(r.is_empty());
}
