//! Random event sequences against the decode queues (issue 21), with a model pool that carries
//! out their actions: whatever arrives (requests, duplicates, ends with and without a write
//! landing, stale events for rooms elsewhere, time passing), the pool is never asked for a
//! page it lacks, the pages add up (`free + held + draining = pool`, and the queues agree with
//! the model request by request), a running request holds the pages its next token needs
//! after every `MakeRoom`, and once every request has ended and every write landed, every
//! page is free. And, driven as the engine drives it, under memory pressure every request
//! generates all its tokens. Requests for several sequences fork, and the model pool checks
//! that the pages their sequences share go back exactly once, with the last of them.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use proptest::prelude::*;

use ferry_cluster::Room;

use super::{Action, Admission, Event, Limits, Queues, Stage};

const POOL: usize = 12;

#[derive(Debug, Clone)]
enum Ev {
    Request { room: u64, prompt: usize, limit: usize, local: bool, n: usize },
    Fork(u64),
    Admit,
    Transferred(u64),
    Computed(u64),
    Joined(u64),
    Token(u64),
    MakeRoom,
    Stepped(bool),
    End { room: u64, writing: bool },
    Released(u64),
    Tick(u64),
}

fn ev() -> impl Strategy<Value = Ev> {
    let room = 0u64..5;
    prop_oneof![
        3 => (room.clone(), 1usize..10, 0usize..12, any::<bool>(), prop_oneof![3 => Just(1usize), 1 => 2usize..4])
            .prop_map(|(room, prompt, limit, local, n)| Ev::Request { room, prompt, limit, local, n }),
        1 => room.clone().prop_map(Ev::Fork),
        3 => Just(Ev::Admit),
        1 => room.clone().prop_map(Ev::Transferred),
        1 => room.clone().prop_map(Ev::Computed),
        1 => room.clone().prop_map(Ev::Joined),
        3 => room.clone().prop_map(Ev::Token),
        3 => Just(Ev::MakeRoom),
        1 => any::<bool>().prop_map(Ev::Stepped),
        1 => (room.clone(), proptest::bool::weighted(0.3)).prop_map(|(room, writing)| Ev::End { room, writing }),
        1 => room.prop_map(Ev::Released),
        1 => (0u64..1500).prop_map(Ev::Tick),
    ]
}

fn id(room: u64) -> Room {
    Room::new(room).expect("63 bits")
}

fn limits(admission: Admission) -> Limits {
    Limits {
        max_running: 4,
        prealloc_timeout: Duration::from_secs(1),
        waiting_timeout: Duration::from_secs(2),
        page_size: 2,
        admission,
    }
}

fn admission() -> impl Strategy<Value = Admission> {
    prop_oneof![
        (0usize..6).prop_map(|tokens| Admission::Reserved { tokens }),
        (0.0f64..1.0, 1u32..50).prop_map(|(init, steps)| Admission::Adaptive { init, min: init / 4.0, steps }),
    ]
}

/// The rooms of the other sequences of room `room` when it forks into `n`.
fn children(room: u64, n: usize) -> Vec<Room> {
    (1..n as u64).map(|k| id(100 + room * 8 + k)).collect()
}

/// The pool as the engine's: pages handed out per request, and aside while being written;
/// pages forked sequences share, by group.
#[derive(Default)]
struct Pool {
    free: usize,
    held: HashMap<Room, usize>,
    draining: HashMap<Room, usize>,
    /// Group → (pages, sequences reading them).
    groups: HashMap<Room, (usize, usize)>,
    /// Sequence → its group.
    member: HashMap<Room, Room>,
}

impl Pool {
    /// `room` forked: `children` take a page each of its pages, and `shared` of them become
    /// the group's.
    fn fork(&mut self, room: Room, children: &[Room], shared: usize) {
        let held = self.held.get_mut(&room).expect("a forked request holds pages");
        *held -= shared + children.len();
        for &c in children {
            self.held.insert(c, 1);
            self.member.insert(c, room);
        }
        self.member.insert(room, room);
        self.groups.insert(room, (shared, children.len() + 1));
    }

    /// The pages that go back with `room` besides its own: its group's, when it was their
    /// last reader.
    fn leave(&mut self, room: Room) -> usize {
        let Some(g) = self.member.remove(&room) else { return 0 };
        let group = self.groups.get_mut(&g).expect("its group");
        group.1 -= 1;
        if group.1 > 0 {
            return 0;
        }
        self.groups.remove(&g).map_or(0, |g| g.0)
    }

    fn shared(&self) -> usize {
        self.groups.values().map(|g| g.0).sum()
    }

    fn take(&mut self, room: Room, pages: usize) {
        assert!(pages <= self.free, "{room}: {pages} pages asked, {} free", self.free);
        self.free -= pages;
        *self.held.entry(room).or_default() += pages;
    }

    fn carry_out(&mut self, actions: &[Action]) {
        for a in actions {
            match *a {
                Action::Allocate { room, pages, .. } | Action::Grow { room, pages } => self.take(room, pages),
                Action::Retract { room, pages, .. } => {
                    let group = self.leave(room);
                    assert_eq!(self.held.remove(&room).map(|h| h + group), Some(pages), "{room} retracted");
                    self.free += pages;
                }
                Action::Free { room, pages } => {
                    let group = self.leave(room);
                    let from = self.held.remove(&room).or_else(|| self.draining.remove(&room));
                    assert_eq!(from.map(|h| h + group), Some(pages), "{room} freed");
                    self.free += pages;
                }
                Action::Drain { room, pages } => {
                    // A forked sequence leaves its group whatever it ends with (the queues free
                    // the group's pages with its last member, never aside).
                    let group = self.leave(room);
                    assert_eq!(group, 0, "{room}: the last member of a group frees its pages, never drains them");
                    assert_eq!(self.held.remove(&room), Some(pages), "{room} drained");
                    self.draining.insert(room, pages);
                }
                Action::Refuse(_) | Action::Expired { .. } | Action::Land(_) | Action::Fail(_) => {}
            }
        }
    }
}

/// Every room the test may use: 0..5 and their sequences.
fn rooms() -> impl Iterator<Item = Room> {
    (0..5).map(id).chain((0..5).flat_map(|r| children(r, 4)))
}

fn check(q: &Queues, pool: &Pool) {
    assert_eq!(q.free_pages(), pool.free, "free pages");
    let held = pool.held.values().sum::<usize>();
    assert_eq!(pool.free + held + pool.draining.values().sum::<usize>() + pool.shared(), POOL);
    assert_eq!(q.draining(), pool.draining.values().sum::<usize>(), "draining pages");
    assert_eq!(q.shared(), pool.shared(), "shared pages");
    for room in rooms() {
        assert_eq!(q.held(room), pool.held.get(&room).copied().unwrap_or(0), "{room}: pages held");
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]
    #[test]
    fn pages_add_up_whatever_arrives(admission in admission(), evs in proptest::collection::vec(ev(), 1..150)) {
        let t0 = Instant::now();
        let mut now = t0;
        let mut q = Queues::new(limits(admission), POOL);
        let mut pool = Pool { free: POOL, ..Pool::default() };
        // Prompt and tokens generated, as the queues should know them; sequences asked for.
        let mut seq: HashMap<Room, (usize, usize)> = HashMap::new();
        let mut asked: HashMap<Room, usize> = HashMap::new();
        for e in evs {
            let event = match e {
                Ev::Request { room, prompt, limit, local, n } => {
                    Event::Request { room: id(room), prompt, limit, local, n, forks: n - 1 }
                }
                Ev::Fork(r) => {
                    let n = asked.get(&id(r)).copied().unwrap_or(2).max(2);
                    Event::Fork { room: id(r), children: children(r, n) }
                }
                Ev::Admit => Event::Admit,
                Ev::Transferred(r) => Event::Transferred(id(r)),
                Ev::Computed(r) => Event::Computed(id(r)),
                Ev::Joined(r) => Event::Joined(id(r)),
                Ev::Token(r) => Event::Token(id(r)),
                Ev::MakeRoom => Event::MakeRoom,
                Ev::Stepped(decoding) => Event::Stepped { decoding },
                Ev::End { room, writing } => Event::End { room: id(room), writing },
                Ev::Released(r) => Event::Released(id(r)),
                Ev::Tick(ms) => {
                    now += Duration::from_millis(ms);
                    Event::Tick
                }
            };
            let before = q.stage(match &event {
                Event::Request { room, .. } | Event::Token(room) | Event::End { room, .. } | Event::Fork { room, .. } => *room,
                _ => id(0),
            });
            // Rooms for a fork's sequences that no live sequence has.
            let fresh = match &event {
                Event::Fork { children, .. } => children.iter().all(|c| q.stage(*c).is_none()),
                _ => false,
            };
            let actions = q.on(event.clone(), now);
            pool.carry_out(&actions);
            if let Event::Fork { room, children } = &event {
                // It forks when it stands for these sequences and its prompt's KV is complete.
                let forks = fresh
                    && asked.get(room) == Some(&(children.len() + 1))
                    && !matches!(before, None | Some(Stage::Prealloc | Stage::Transfer));
                prop_assert_eq!(fresh && q.stage(children[0]).is_some(), forks, "{} forked", room);
                if forks {
                    asked.remove(room);
                    let (prompt, _) = seq[room];
                    pool.fork(*room, children, prompt.div_ceil(2) - 1);
                    for &c in children {
                        prop_assert_eq!(q.stage(c), Some(Stage::Prefill));
                        seq.insert(c, (prompt, 0));
                    }
                }
            }
            check(&q, &pool);
            match event {
                Event::Request { room, prompt, limit, n, .. } => {
                    let refused = matches!(actions.as_slice(), [Action::Refuse(_)]);
                    let grouped = pool.groups.contains_key(&room);
                    // Could never fit the pool whole (n never exceeds the 4 the node runs).
                    let over = ferry_cluster::fork_pages(prompt, prompt + limit, n, 2) > POOL;
                    prop_assert_eq!(refused, before.is_some() || q.is_draining(room) || grouped || over);
                    if !refused {
                        seq.insert(room, (prompt, 0));
                        asked.insert(room, n);
                    }
                }
                Event::Token(room) if before.is_some() => {
                    if let Some(s) = seq.get_mut(&room) {
                        s.1 += 1;
                    }
                }
                Event::End { room, .. } => {
                    seq.remove(&room);
                    asked.remove(&room);
                    prop_assert!(q.stage(room).is_none());
                }
                Event::MakeRoom => {
                    // Never cut: each running request can compute its next token (in its
                    // own pages and those it shares).
                    for room in q.in_stage(Stage::Running) {
                        let (prompt, generated) = seq[&room];
                        let shared = pool.member.get(&room).map_or(0, |g| pool.groups[g].0);
                        prop_assert!((shared + q.held(room)) * 2 >= prompt + generated, "{} short after MakeRoom", room);
                    }
                }
                Event::Tick => {
                    for a in &actions {
                        let Action::Expired { stage, .. } = a else { panic!("tick: {a:?}") };
                        prop_assert!(matches!(stage, Stage::Prealloc | Stage::Waiting));
                    }
                }
                _ => {}
            }
        }
        // Every request ends, every write lands: the whole pool is free again.
        for room in rooms() {
            let a = q.on(Event::End { room, writing: false }, now);
            pool.carry_out(&a);
            let a = q.on(Event::Released(room), now);
            pool.carry_out(&a);
        }
        check(&q, &pool);
        prop_assert!(q.is_empty());
        prop_assert_eq!((q.free_pages(), q.draining(), q.shared()), (POOL, 0, 0));
    }
}

/// A small decode node driven as the engine drives it: admission, local prefill (the first
/// token sampled with a fresh prompt's last chunk; a retracted request recomputes and goes
/// on), `MakeRoom`, a token for every running request that can take one. Whatever the
/// estimate, every request generates all its tokens within a bounded number of steps, and
/// the pool is never over-committed (the model pool asserts it).
#[test]
fn under_pressure_every_request_completes_and_pages_are_conserved() {
    for (seed, admission) in (1..=40u64).flat_map(|s| {
        [
            (s, Admission::Adaptive { init: 0.7, min: 0.05, steps: 65 }),
            (s, Admission::Reserved { tokens: 4 }),
            (s, Admission::Adaptive { init: 0.0, min: 0.0, steps: 1 }),
        ]
    }) {
        simulate(seed, admission);
    }
}

fn simulate(seed: u64, admission: Admission) {
    let mut rng = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut next = |m: u64| {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng % m
    };
    let pages = 40 + next(40) as usize;
    let t0 = Instant::now();
    let mut q = Queues::new(Limits { page_size: 1, max_running: 64, ..limits(admission) }, pages);
    let mut pool = Pool { free: pages, ..Pool::default() };
    // (prompt, max_new, n) per request; every fourth asks for 2 or 3 sequences. They fit the
    // pool (the worker refuses the rest): the prompt's full pages once, the rest n times.
    let reqs: Vec<(usize, usize, usize)> = (0..12)
        .map(|i| {
            let n = if i % 4 == 3 { 2 + next(2) as usize } else { 1 };
            let p = 1 + next(10) as usize;
            let most = (pages + 1 - p) / n - 1;
            (p, 1 + next(most as u64) as usize, n)
        })
        .collect();
    // Every sequence: (prompt, max_new, generated); a fork's sequences join when it forks.
    let mut seqs: HashMap<Room, (usize, usize, usize)> = HashMap::new();
    for (room, &(prompt, limit, n)) in reqs.iter().enumerate() {
        assert!(
            q.on(Event::Request { room: id(room as u64), prompt, limit, local: true, n, forks: n - 1 }, t0).is_empty()
        );
        seqs.insert(id(room as u64), (prompt, limit, 0));
    }
    let want: usize = reqs.iter().map(|r| r.2).sum();
    let mut done = 0;
    for step in 0.. {
        assert!(step < 100_000, "seed {seed} {admission:?}: no end in sight");
        let a = q.on(Event::Admit, t0);
        pool.carry_out(&a);
        // Local prefill in one pass: a fresh prompt samples its first token; a request for
        // several sequences forks then.
        for room in q.in_stage(Stage::Prefill) {
            q.on(Event::Computed(room), t0);
            let s = seqs.get_mut(&room).expect("known");
            if s.2 == 0 {
                q.on(Event::Token(room), t0);
                s.2 += 1;
                let prompt = s.0;
                let r = room.get();
                if let Some(&(_, limit, n)) = reqs.get(r as usize).filter(|x| x.2 > 1 && r < 100) {
                    let kids = children(r, n);
                    q.on(Event::Fork { room, children: kids.clone() }, t0);
                    pool.fork(room, &kids, prompt - 1);
                    for c in kids {
                        seqs.insert(c, (prompt, limit, 0));
                    }
                }
            }
        }
        let a = q.on(Event::MakeRoom, t0);
        pool.carry_out(&a);
        let running = q.in_stage(Stage::Running);
        if running.is_empty() && q.in_stage(Stage::Prefill).is_empty() {
            let left: Vec<_> = seqs.iter().filter(|(_, s)| s.2 < s.1).map(|(r, s)| (*r, *s, q.stage(*r))).collect();
            assert_eq!(done, want, "seed {seed} {admission:?}: stuck with {} free of {pages}: {left:?}", pool.free);
            break;
        }
        for room in running {
            let (prompt, limit, generated) = seqs[&room];
            if generated == limit {
                let a = q.on(Event::End { room, writing: false }, t0);
                pool.carry_out(&a);
                done += 1;
                continue;
            }
            let shared = pool.member.get(&room).map_or(0, |g| pool.groups[g].0);
            assert!(shared + q.held(room) > prompt + generated - 1, "seed {seed}: {room} cannot compute its token");
            q.on(Event::Token(room), t0);
            seqs.get_mut(&room).expect("known").2 += 1;
        }
        q.on(Event::Stepped { decoding: true }, t0);
        check_sum(&q, &pool, pages);
    }
    for (room, &(_, limit, generated)) in &seqs {
        assert_eq!(generated, limit, "seed {seed}: {room} was cut");
    }
    assert_eq!(seqs.len(), want, "every sequence ran");
    assert!(q.is_empty());
    assert_eq!(q.free_pages(), pages);
}

fn check_sum(q: &Queues, pool: &Pool, pages: usize) {
    assert_eq!(q.free_pages(), pool.free);
    assert_eq!(q.shared(), pool.shared());
    assert_eq!(pool.free + pool.held.values().sum::<usize>() + pool.shared(), pages);
}
