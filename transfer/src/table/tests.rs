//! The room table's rules, one by one, and random sequences of operations.

use super::*;
use crate::frame::Kind;

/// The rooms ended so far, by plain id (for matching).
fn drained(t: &mut RoomTable) -> Vec<(u64, Outcome)> {
    t.drain_ended().into_iter().map(|(r, o)| (r.get(), o)).collect()
}

fn pages_header(room: Room, secret: RoomSecret, first: u32, n: u32) -> Header {
    Header { kind: Kind::Pages, room, secret, dst_page: first, n_pages: n, payload_len: 0, payload_crc: 0 }
}

/// An RDMA grant is a lease on the room's pages: a room closed while its sender holds
/// windows keeps its pages until the lease ends; a lease ended first releases at once.
#[test]
fn a_granted_room_keeps_its_pages_until_its_lease_ends() {
    let now = Instant::now();
    let mut t = RoomTable::new(Timeouts::default());
    let (a, b) = (Room::from(1u32), Room::from(2u32));
    t.open(a, RoomSecret::from([1; 16]), &[12, 10, 11], now).expect("open");
    assert_eq!(t.grant(a, &RoomSecret::from([9; 16])), Err(Refusal::WrongSecret));
    assert_eq!(t.grant(a, &RoomSecret::from([1; 16])), Ok(vec![10, 11, 12]), "sorted");
    assert_eq!(t.grant(a, &RoomSecret::from([1; 16])), Err(Refusal::Closed), "once");
    t.close(a);
    assert!(t.writing(a) && t.leased_closing(a), "held while its sender may write");
    assert_eq!(t.open(b, RoomSecret::from([2; 16]), &[11], now), Err(Refusal::PagesInUse));
    t.end_lease(a);
    assert!(!t.writing(a));
    assert_eq!(t.drain_released(), vec![a]);
    t.open(b, RoomSecret::from([2; 16]), &[11], now).expect("free again");
    assert_eq!(t.grant(b, &RoomSecret::from([2; 16])), Ok(vec![11]));
    t.end_lease(b);
    t.close(b);
    assert!(!t.writing(b), "a lease ended before the close holds nothing");
}

#[test]
fn frames_are_checked_against_the_room() {
    let now = Instant::now();
    let mut t = RoomTable::new(Timeouts::default());
    t.open(Room::from(1u32), RoomSecret::from([1; 16]), &[10, 11, 12, 20], now).expect("open");
    assert_eq!(t.open(Room::from(1u32), RoomSecret::from([1; 16]), &[30], now), Err(Refusal::DuplicateRoom));
    assert_eq!(t.open(Room::from(2u32), RoomSecret::from([2; 16]), &[12], now), Err(Refusal::PagesInUse));
    assert_eq!(
        t.claim(&pages_header(Room::from(9u32), RoomSecret::from([1; 16]), 10, 1), now),
        Err(Refusal::UnknownRoom)
    );
    assert_eq!(
        t.claim(&pages_header(Room::from(1u32), RoomSecret::from([0; 16]), 10, 1), now),
        Err(Refusal::WrongSecret)
    );
    assert_eq!(
        t.claim(&pages_header(Room::from(1u32), RoomSecret::from([1; 16]), 12, 2), now),
        Err(Refusal::OutsideRoom),
        "page 13 is not the room's"
    );
    assert_eq!(
        t.claim(&pages_header(Room::from(1u32), RoomSecret::from([1; 16]), u32::MAX, 2), now),
        Err(Refusal::OutsideRoom)
    );
    assert_eq!(
        t.claim(&pages_header(Room::from(1u32), RoomSecret::from([1; 16]), u32::MAX - 1, 2), now),
        Err(Refusal::OutsideRoom),
        "ends at 2^32"
    );
    let c = t.claim(&pages_header(Room::from(1u32), RoomSecret::from([1; 16]), 10, 3), now).expect("claim");
    assert_eq!(
        t.claim(&pages_header(Room::from(1u32), RoomSecret::from([1; 16]), 11, 1), now),
        Err(Refusal::Duplicate),
        "claimed pages"
    );
    t.commit(c, now);
    assert_eq!(
        t.claim(&pages_header(Room::from(1u32), RoomSecret::from([1; 16]), 10, 1), now),
        Err(Refusal::Duplicate),
        "received pages"
    );
    // Done before the last page: completes when it arrives.
    t.done(Room::from(1u32), Aux { first_token: 5, logprob: -0.1, room_echo: 1, total_pages: 4 }, now);
    assert!(drained(&mut t).is_empty());
    let c = t.claim(&pages_header(Room::from(1u32), RoomSecret::from([1; 16]), 20, 1), now).expect("claim");
    t.commit(c, now);
    let ended = drained(&mut t);
    assert!(matches!(ended.as_slice(), [(1, Outcome::Success(a))] if a.first_token == 5));
    assert_eq!(t.claim(&pages_header(Room::from(1u32), RoomSecret::from([1; 16]), 20, 1), now), Err(Refusal::Closed));
    assert_eq!(t.close(Room::from(1u32)), Some(State::Success));
    assert_eq!((t.open_rooms(), t.held_pages()), (0, 0));
    assert_eq!(t.refusals(Refusal::Duplicate), 2);
}

#[test]
fn wrong_aux_timeouts_and_aborts_fail_the_room() {
    let now = Instant::now();
    let mut t = RoomTable::new(Timeouts::default());
    t.open(Room::from(1u32), RoomSecret::from([1; 16]), &[1], now).expect("open");
    t.done(Room::from(1u32), Aux { first_token: 0, logprob: 0.0, room_echo: 1, total_pages: 7 }, now);
    assert!(matches!(drained(&mut t).as_slice(), [(1, Outcome::Failed(FailReason::Corrupt(_)))]));
    t.open(Room::from(2u32), RoomSecret::from([2; 16]), &[2], now).expect("open");
    t.tick(now + Timeouts::default().waiting);
    assert!(matches!(drained(&mut t).as_slice(), [(2, Outcome::Failed(FailReason::Timeout(State::WaitingForInput)))]));
    t.open(Room::from(3u32), RoomSecret::from([3; 16]), &[3], now).expect("open");
    t.fail(Room::from(3u32), FailReason::Aborted("client".into()));
    assert_eq!(drained(&mut t).len(), 1);
    for r in (1..=3u32).map(Room::from) {
        t.close(r);
    }
    assert_eq!((t.open_rooms(), t.held_pages()), (0, 0));
}

/// Issue 21's stale write: a run of room 1 stalls mid-payload, the request is cancelled
/// (room 1 closed), and a caller opens room 1 again and sends one valid frame. That frame
/// must not settle the old incarnation's stalled run: its pages must stay owned until the
/// stalled write itself ends, or the next request handed them gets the late payload.
#[test]
fn a_reopened_room_id_cannot_settle_a_stalled_write_of_its_earlier_incarnation() {
    let now = Instant::now();
    let mut t = RoomTable::new(Timeouts::default());
    t.open(Room::from(1u32), RoomSecret::from([1; 16]), &[5, 6], now).expect("open");
    let stalled = t.claim(&pages_header(Room::from(1u32), RoomSecret::from([1; 16]), 5, 1), now).expect("claim");
    assert_eq!(t.close(Room::from(1u32)), Some(State::Transferring));
    match t.open(Room::from(1u32), RoomSecret::from([1; 16]), &[7], now) {
        Err(r) => assert_eq!(r, Refusal::RoomClosing),
        Ok(()) => {
            let c = t
                .claim(&pages_header(Room::from(1u32), RoomSecret::from([1; 16]), 7, 1), now)
                .expect("claim the new room's page");
            t.commit(c, now);
        }
    }
    assert_eq!(
        t.open(Room::from(2u32), RoomSecret::from([2; 16]), &[5, 6], now),
        Err(Refusal::PagesInUse),
        "pages 5 and 6 handed out while a write into page 5 may still land"
    );
    t.commit(stalled, now);
    assert!(!t.writing(Room::from(1u32)));
    t.open(Room::from(2u32), RoomSecret::from([2; 16]), &[5, 6], now).expect("free once the stalled write ended");
    t.open(Room::from(1u32), RoomSecret::from([1; 16]), &[7], now).expect("the id is free again too");
    assert_eq!(t.refusals(Refusal::RoomClosing), 1);
}

#[test]
fn a_room_closed_mid_write_keeps_its_pages_until_the_write_settles() {
    let now = Instant::now();
    let mut t = RoomTable::new(Timeouts::default());
    t.open(Room::from(1u32), RoomSecret::from([1; 16]), &[5, 6, 7], now).expect("open");
    let writing = t.claim(&pages_header(Room::from(1u32), RoomSecret::from([1; 16]), 5, 2), now).expect("claim");
    assert_eq!(t.close(Room::from(1u32)), Some(State::Transferring));
    assert!(t.writing(Room::from(1u32)), "a run is still being written into pages 5 and 6");
    assert_eq!(
        t.open(Room::from(2u32), RoomSecret::from([2; 16]), &[6], now),
        Err(Refusal::PagesInUse),
        "not reusable yet"
    );
    assert!(t.drain_released().is_empty());
    t.unclaim(writing);
    assert!(!t.writing(Room::from(1u32)));
    assert_eq!(t.drain_released(), vec![Room::from(1u32)], "the owner is told the pages are free");
    t.open(Room::from(2u32), RoomSecret::from([2; 16]), &[5, 6, 7], now).expect("free again once the write ended");
    // A failed checksum ends the claim too: the room fails, its pages are expected again.
    let c = t.claim(&pages_header(Room::from(2u32), RoomSecret::from([2; 16]), 7, 1), now).expect("claim");
    t.unclaim(c);
    t.fail(Room::from(2u32), FailReason::Corrupt("crc".into()));
    t.close(Room::from(2u32));
    assert!(!t.writing(Room::from(2u32)));
    assert_eq!((t.open_rooms(), t.held_pages()), (0, 0));
}

mod random {
    //! Random sequences of opens, claims, settles (commit or unclaim, in any order), `Done`
    //! frames, failures, closes and timeouts over a few room ids and 16 pages. After every
    //! step: a page being written belongs to the writer's own incarnation (never free, never
    //! another room's), open and closing rooms hold disjoint pages and exactly the pages
    //! counted as held; at the end every room opened ended once with a reason and every page
    //! is free.

    use std::collections::{HashMap, HashSet};
    use std::time::Duration;

    use proptest::prelude::*;

    use super::*;

    #[derive(Debug, Clone)]
    enum Op {
        Open { room: Room, first: u32, n: u32 },
        Claim { room: Room, first: u32, n: u32, wrong_secret: bool, anywhere: bool },
        Settle { which: usize, ok: bool },
        Done { room: Room, total: u32 },
        Fail { room: Room },
        Close { room: Room },
        Tick { secs: u64 },
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            3 => (0u32..3, 0u32..16, 1u32..5).prop_map(|(room, first, n)| Op::Open { room: room.into(), first, n }),
            // Mostly runs starting at one of the room's own pages (`first` picks which), so
            // that claims succeed; sometimes anywhere.
            4 => (0u32..3, 0u32..17, 1u32..4, 0u8..8, 0u8..4).prop_map(|(room, first, n, wrong, anywhere)| Op::Claim {
                room: room.into(),
                first,
                n,
                wrong_secret: wrong == 0,
                anywhere: anywhere == 0
            }),
            2 => (any::<usize>(), any::<bool>()).prop_map(|(which, ok)| Op::Settle { which, ok }),
            1 => (0u32..3, 1u32..5).prop_map(|(room, total)| Op::Done { room: room.into(), total }),
            1 => (0u32..3).prop_map(|room| Op::Fail { room: room.into() }),
            2 => (0u32..3).prop_map(|room| Op::Close { room: room.into() }),
            1 => (0u64..40).prop_map(|secs| Op::Tick { secs }),
        ]
    }

    fn secret(room: Room) -> RoomSecret {
        RoomSecret::from([room.get() as u8 + 1; 16])
    }

    fn check(t: &RoomTable, writing: &[Claim]) {
        let mut held = HashSet::new();
        for (&id, r) in &t.rooms {
            for &p in r.pages.keys() {
                assert!(held.insert(p), "page {p} in two rooms");
                assert_eq!(t.owners.get(&PageId(p)), Some(&id), "page {p} of room {id} not owned by it");
            }
        }
        for (&id, z) in &t.closing {
            assert!(t.rooms.get(&id).is_none_or(|r| r.incarnation != z.incarnation));
            for &p in &z.pages {
                assert!(held.insert(p), "closing page {p} also in another room");
                assert_eq!(t.owners.get(&PageId(p)), Some(&id));
            }
        }
        assert_eq!(held.len(), t.held_pages(), "owners holds pages of no room");
        for c in writing {
            let own = t.rooms.get(&c.room).is_some_and(|r| r.incarnation == c.incarnation)
                || t.closing.get(&c.room).is_some_and(|z| z.incarnation == c.incarnation);
            assert!(own, "{c:?} is being written but its room incarnation let go of it");
            for p in c.first..c.first + c.n {
                assert_eq!(t.owners.get(&PageId(p)), Some(&c.room), "page {p} being written is free or another room's");
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(3000))]
        #[test]
        fn pages_being_written_stay_their_incarnations_and_every_room_ends(ops in proptest::collection::vec(op(), 1..120)) {
            let start = Instant::now();
            let mut now = start;
            let mut t = RoomTable::new(Timeouts {
                bootstrap: Duration::from_secs(30),
                waiting: Duration::from_secs(60),
                transferring: Duration::from_secs(30),
            });
            let mut writing: Vec<Claim> = Vec::new();
            let (mut opened, mut ended) = (0usize, HashMap::<Room, usize>::new());
            let mut count = |t: &mut RoomTable| {
                for (room, _) in t.drain_ended() {
                    *ended.entry(room).or_default() += 1;
                }
            };
            for op in ops {
                match op {
                    Op::Open { room, first, n } => {
                        let dest: Vec<u32> = (first..first + n).map(|p| p % 16).collect();
                        if t.open(room, secret(room), &dest, now).is_ok() {
                            opened += 1;
                        }
                    }
                    Op::Claim { room, first, n, wrong_secret, anywhere } => {
                        let s = if wrong_secret { RoomSecret::from([0; 16]) } else { secret(room) };
                        let first = match t.rooms.get(&room) {
                            Some(r) if !anywhere => {
                                let mut own: Vec<u32> = r.pages.keys().copied().collect();
                                own.sort_unstable();
                                own[first as usize % own.len()]
                            }
                            _ => first,
                        };
                        let h = Header { kind: crate::frame::Kind::Pages, room, secret: s, dst_page: first, n_pages: n, payload_len: 0, payload_crc: 0 };
                        if let Ok(c) = t.claim(&h, now) {
                            prop_assert!(!wrong_secret);
                            writing.push(c);
                        }
                    }
                    Op::Settle { which, ok } => {
                        if !writing.is_empty() {
                            let c = writing.remove(which % writing.len());
                            if ok { t.commit(c, now) } else { t.unclaim(c) }
                        }
                    }
                    Op::Done { room, total } => {
                        let h = Header { kind: crate::frame::Kind::Done, room, secret: secret(room), dst_page: 0, n_pages: 0, payload_len: 0, payload_crc: 0 };
                        if t.check_control(&h).is_ok() {
                            t.done(room, Aux { first_token: 1, logprob: 0.0, room_echo: room.get(), total_pages: total }, now);
                        }
                    }
                    Op::Fail { room } => t.fail(room, FailReason::Aborted("test".into())),
                    // As the inbox closes a room: fail it (when it has not ended), then forget it.
                    Op::Close { room } => {
                        t.fail(room, FailReason::Aborted("closed".into()));
                        t.close(room);
                    }
                    Op::Tick { secs } => {
                        now += Duration::from_secs(secs);
                        t.tick(now);
                    }
                }
                count(&mut t);
                check(&t, &writing);
            }
            // Every write ends, every room is closed: all pages free, each room ended once.
            for c in std::mem::take(&mut writing) {
                t.unclaim(c);
            }
            for room in (0..3u32).map(Room::from) {
                t.fail(room, FailReason::Aborted("end".into()));
                t.close(room);
            }
            count(&mut t);
            check(&t, &[]);
            prop_assert_eq!((t.open_rooms(), t.held_pages(), t.closing.len()), (0, 0, 0));
            prop_assert_eq!(ended.values().sum::<usize>(), opened, "every room opened ended once: {:?}", ended);
        }
    }
}
