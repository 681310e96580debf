use super::*;

/// Page size 1, so tokens and pages are the same numbers; a pool too large to matter (these
/// tests give admission its free pages).
fn queues(max_running: usize, admission: Admission) -> Queues {
    let s = Duration::from_secs(1);
    Queues::new(Limits { max_running, prealloc_timeout: s, waiting_timeout: 2 * s, page_size: 1, admission }, 1 << 20)
}

fn reserved(tokens: usize) -> Admission {
    Admission::Reserved { tokens }
}

fn rooms(a: &[Action]) -> Vec<u64> {
    a.iter()
        .map(|x| match x {
            Action::Allocate { room, .. } => room.get(),
            other => panic!("not an allocation: {other:?}"),
        })
        .collect()
}

fn rid(id: u64) -> Room {
    Room::new(id).expect("63 bits")
}

#[test]
fn a_fixed_reservation_is_kept_and_admission_is_first_come_first_served() {
    let t0 = Instant::now();
    let mut q = queues(8, reserved(2));
    q.push(rid(1), 4, 10, false, (1, 0), t0).expect("new");
    q.push(rid(2), 3, 10, true, (1, 0), t0).expect("new");
    q.push(rid(3), 1, 0, false, (1, 0), t0).expect("new");
    // 10 free: room 1 takes 4 + promises 2; room 2 needs 3 + 2 on top of 2 promised: 4 left.
    let a = q.admit_within(10, t0);
    assert_eq!(a, vec![Action::Allocate { room: rid(1), pages: 4, local: false }]);
    assert_eq!(q.promised(), 2);
    // Room 3 would fit, but room 2 is ahead: head of line blocks.
    assert!(q.admit_within(6, t0).is_empty());
    assert_eq!(rooms(&q.admit_within(7, t0)), vec![2]);
    assert_eq!(q.stage(rid(2)), Some(Stage::Prefill));
    // Room 1 decodes 2 tokens: it takes the 2 pages promised to it.
    for ev in [Event::Transferred(rid(1)), Event::Joined(rid(1)), Event::Token(rid(1)), Event::Token(rid(1))] {
        assert!(q.on(ev, t0).is_empty());
    }
    assert_eq!(q.on(Event::MakeRoom, t0), vec![Action::Grow { room: rid(1), pages: 2 }]);
    assert_eq!(q.promised(), 2, "room 1 took its own 2; room 2's 2 are still promised");
    assert_eq!(q.on(Event::End { room: rid(1), writing: false }, t0), vec![Action::Free { room: rid(1), pages: 6 }]);
    assert!(q.admit_within(2, t0).is_empty(), "2 free pages are promised to room 2");
    assert_eq!(rooms(&q.admit_within(3, t0)), vec![3]);
}

#[test]
fn the_reservation_never_exceeds_what_a_request_may_generate() {
    let t0 = Instant::now();
    let mut q = queues(8, reserved(256));
    q.push(rid(1), 4, 3, true, (1, 0), t0).expect("new");
    assert_eq!(rooms(&q.admit_within(7, t0)), vec![1]);
    assert_eq!(q.promised(), 3);
}

#[test]
fn limits_duplicates_and_timeouts() {
    let t0 = Instant::now();
    let mut q = queues(1, reserved(0));
    q.push(rid(1), 1, 0, false, (1, 0), t0).expect("new");
    assert_eq!(q.push(rid(1), 1, 0, false, (1, 0), t0), Err(Refusal::DuplicateRoom));
    q.push(rid(2), 1, 0, false, (1, 0), t0).expect("new");
    assert_eq!(q.admit_within(100, t0).len(), 1, "max_running = 1");
    q.on(Event::Transferred(rid(1)), t0);
    let s = Duration::from_secs(1);
    assert_eq!(q.expired(t0 + s), vec![(rid(2), Stage::Prealloc)]);
    let mut late = q.expired(t0 + 2 * s);
    late.sort_unstable_by_key(|x| x.0);
    assert_eq!(late, vec![(rid(1), Stage::Waiting), (rid(2), Stage::Prealloc)]);
    assert!(Queues::could_fit(10, 10) && !Queues::could_fit(10, 11));
    assert_eq!(q.depth()[&Stage::Waiting], 1);
}

#[test]
fn the_adaptive_estimate_decays_and_follows_what_requests_show_after_a_retraction() {
    let t0 = Instant::now();
    let mut q = queues(8, Admission::Adaptive { init: 0.5, min: 0.1, steps: 4 });
    // 0.5 × 100 tokens: 50 pages estimated on top of a 10-token prompt.
    q.push(rid(1), 10, 100, true, (1, 0), t0).expect("new");
    assert!(q.admit_within(59, t0).is_empty());
    assert_eq!(rooms(&q.admit_within(60, t0)), vec![1]);
    assert_eq!(q.promised(), 50);
    for _ in 0..10 {
        q.decoded();
    }
    assert!((q.ratio() - 0.1).abs() < 1e-9, "floored at min: {}", q.ratio());
    assert_eq!(q.promised(), 10, "the admitted request's estimate falls with the ratio");
    for _ in 0..30 {
        q.on(Event::Token(rid(1)), t0);
    }
    assert_eq!(q.promised(), 7, "and with what it generated: 0.1 × 70");
    q.push(rid(2), 10, 100, true, (1, 0), t0).expect("new");
    // 10 + 10 pages on top of room 1's 7 promised.
    assert!(q.admit_within(26, t0).is_empty());
    assert_eq!(rooms(&q.admit_within(27, t0)), vec![2]);

    // Room 2 is retracted at once: room 1, still running, has generated 30 of 100, so the
    // ratio becomes (30 + 20) / 100. Room 2 goes to the front of the queue and prefills here.
    q.on(Event::Computed(rid(1)), t0);
    q.push(rid(3), 1, 1, false, (1, 0), t0).expect("new");
    assert_eq!(q.retract(rid(2), t0), Some(Action::Retract { room: rid(2), pages: 10, context: 10, running: false }));
    assert_eq!(q.retract(rid(2), t0), None, "already waiting");
    assert!((q.ratio() - 0.5).abs() < 1e-9, "{}", q.ratio());
    assert_eq!(q.stage(rid(2)), Some(Stage::Prealloc));
    // Room 2: 10 + 50 on top of room 1's 35.
    assert!(q.admit_within(94, t0).is_empty(), "room 3 waits behind retracted room 2");
    let a = q.admit_within(95, t0);
    assert_eq!(a[0], Action::Allocate { room: rid(2), pages: 10, local: true });
    assert_eq!(rooms(&a), vec![2], "room 3's 1 + 1 on top of 85 promised does not fit in the 85 left");
    assert!(q.order(rid(2)) > q.order(rid(1)), "re-admitted: newer than room 1");
    // From where the retraction set it, the ratio falls to min over the same 4 steps.
    q.decoded();
    assert!((q.ratio() - 0.4).abs() < 1e-9, "{}", q.ratio());
    for _ in 0..3 {
        q.decoded();
    }
    assert!((q.ratio() - 0.1).abs() < 1e-9, "{}", q.ratio());
}

#[test]
fn a_ratio_that_starts_at_its_floor_falls_back_to_it_after_a_retraction() {
    let t0 = Instant::now();
    let mut q = queues(8, Admission::Adaptive { init: 0.0, min: 0.0, steps: 2 });
    q.push(rid(1), 10, 100, true, (1, 0), t0).expect("new");
    q.push(rid(2), 10, 100, true, (1, 0), t0).expect("new");
    assert_eq!(rooms(&q.admit_within(20, t0)), vec![1, 2], "nothing promised: the contexts fit");
    q.retract(rid(2), t0);
    assert!((q.ratio() - 0.2).abs() < 1e-9, "room 1 shows (0 + 20) / 100: {}", q.ratio());
    q.decoded();
    q.decoded();
    assert_eq!(q.ratio(), 0.0, "back at the floor after 2 steps");
}

#[test]
fn waiting_for_pages_times_out_only_while_the_node_makes_no_progress() {
    let t0 = Instant::now();
    let s = Duration::from_secs(1);
    let mut q = queues(8, reserved(4));
    q.push(rid(1), 4, 8, true, (1, 0), t0).expect("new");
    q.admit_within(100, t0);
    q.on(Event::Computed(rid(1)), t0);
    q.push(rid(2), 4, 8, true, (1, 0), t0).expect("new");
    // Room 1 decodes every half second: room 2 waits as long as that lasts.
    for i in 1..10 {
        q.on(Event::Stepped { decoding: true }, t0 + s * i / 2);
        assert!(q.expired(t0 + s * i / 2 + s / 2).is_empty(), "step {i}");
    }
    // The node stops computing: room 2 times out a whole timeout after the last pass.
    assert!(q.expired(t0 + s * 5 - s / 10).is_empty());
    assert_eq!(q.expired(t0 + s * 11 / 2), vec![(rid(2), Stage::Prealloc)]);
    // A retracted request waits the same way.
    q.retract(rid(1), t0);
    let mut late = q.expired(t0 + s * 6);
    late.sort_unstable_by_key(|x| x.0);
    assert_eq!(late, vec![(rid(1), Stage::Prealloc), (rid(2), Stage::Prealloc)]);
}

/// The engine sleeps until `next_deadline` when nothing computes: it must be exactly when
/// `expired` first reports a request, and absent when nothing can time out.
#[test]
fn the_next_deadline_is_when_the_first_request_expires() {
    let t0 = Instant::now();
    let s = Duration::from_secs(1);
    let mut q = queues(1, reserved(4));
    assert_eq!((q.next_deadline(), q.computing()), (None, false));
    q.push(rid(1), 4, 8, false, (1, 0), t0).expect("new");
    q.admit_within(100, t0);
    assert_eq!(q.stage(rid(1)), Some(Stage::Transfer));
    assert_eq!((q.next_deadline(), q.computing()), (None, false), "transfers time out in the receiver");
    q.push(rid(2), 4, 8, true, (1, 0), t0 + s / 2).expect("new");
    let d = q.next_deadline().expect("room 2 waits for pages");
    assert_eq!(d, t0 + s / 2 + s);
    assert!(q.expired(d - Duration::from_millis(1)).is_empty());
    assert_eq!(q.expired(d), vec![(rid(2), Stage::Prealloc)]);
    q.on(Event::Stepped { decoding: false }, t0 + s);
    assert_eq!(q.next_deadline(), Some(t0 + 2 * s), "a forward pass moves it");
    q.on(Event::Transferred(rid(1)), t0 + s);
    assert!(q.computing());
    assert_eq!(q.next_deadline(), Some(t0 + 2 * s), "room 2 first; room 1's waiting ends at 3 s");
    q.on(Event::End { room: rid(2), writing: false }, t0 + s);
    assert_eq!(q.next_deadline(), Some(t0 + 3 * s));
    q.on(Event::Joined(rid(1)), t0 + s);
    assert_eq!((q.next_deadline(), q.computing()), (None, true));
}

#[test]
fn the_victim_has_the_least_progress_then_is_the_newest() {
    assert_eq!(victim(&[]), None);
    assert_eq!(victim(&[(rid(1), 5, 1), (rid(2), 3, 2), (rid(3), 9, 3)]), Some(rid(2)));
    assert_eq!(victim(&[(rid(1), 3, 1), (rid(2), 3, 4), (rid(3), 3, 2)]), Some(rid(2)));
}
