//! The rdma protocol on in-memory verbs: the connection exchange runs over real loopback TCP,
//! WRITEs and SENDs go through `MemVerbs`, which can fail, corrupt, disconnect or stall. The
//! calls go through the backend-independent `Sender` / `Receiver` / `SendRoom` layer.

use ferry_core::{Room, RoomSecret};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ferry_transfer::frame::Aux;
use ferry_transfer::memory::HostPages;
use ferry_transfer::rdma::mem::{MemVerbs, VerbsFault};
use ferry_transfer::rdma::{RdmaConfig, RdmaReceiver, RdmaSender};
use ferry_transfer::room::{FailReason, State, Timeouts};
use ferry_transfer::secure::Security;
use ferry_transfer::table::Outcome;
use ferry_transfer::{Receiver, SendRoom, Sender};

use super::common::*;

fn rcfg() -> RdmaConfig {
    let s = Duration::from_secs(2);
    RdmaConfig {
        depth: 8,
        max_write_pages: 4,
        msg_bytes: 256,
        recv_slots: 4,
        op_timeout: Duration::from_secs(1),
        timeouts: Timeouts { bootstrap: s, waiting: s, transferring: s },
    }
}

struct Pair {
    src: Arc<HostPages>,
    rx_mem: Arc<HostPages>,
    receiver: Receiver,
    sender: Arc<Sender>,
}

async fn pair(verbs: MemVerbs) -> Pair {
    let src = Arc::new(source());
    let rx_mem = Arc::new(HostPages::new(PAGE, PAGES).expect("arena"));
    let verbs = Arc::new(verbs);
    let r = RdmaReceiver::bind(any_addr(), Arc::clone(&verbs), Arc::clone(&rx_mem), rcfg(), Security::Plain)
        .await
        .expect("bind");
    let s = connect_for_a_room(&r, verbs, Arc::clone(&src)).await.expect("connect");
    Pair { src, rx_mem, receiver: Receiver::RdmaMem(r), sender: Arc::new(Sender::RdmaMem(Box::new(s))) }
}

/// Connects to `r` the way a prefill node does: showing the key of a room `r` has open (here
/// one opened for the purpose, without pages, and closed again).
async fn connect_for_a_room(
    r: &RdmaReceiver<MemVerbs>,
    verbs: Arc<MemVerbs>,
    src: Arc<HostPages>,
) -> std::io::Result<RdmaSender<MemVerbs>> {
    let room = Room::from(999u32);
    let _done = r.open(room, key(999), &[]).expect("open");
    let s = RdmaSender::connect(r.local_addr(), verbs, src, rcfg(), (room, &key(999)), &Security::Plain).await;
    r.close(room);
    s
}

/// Room `room`'s secret in these tests.
fn key(room: u64) -> RoomSecret {
    RoomSecret::from([room as u8; 16])
}

fn aux(room: u64, pages: usize) -> Aux {
    Aux { first_token: room as u32, logprob: -0.5, room_echo: room, total_pages: pages as u32 }
}

/// A room sent through `SendRoom` in chunks of up to `chunk` pages.
async fn send_room(p: &Pair, room: u64, src: &[u32], dst: &[u32], chunk: usize) -> Result<(), FailReason> {
    let mut r = SendRoom::new(Room::new(room).expect("63 bits"), key(room), rcfg().timeouts, Instant::now());
    assert_eq!(r.poll(Instant::now()), State::Bootstrapping);
    r.handshake(Arc::clone(&p.sender), dst.to_vec(), Instant::now())?;
    let mut at = 0;
    while at < src.len() {
        let k = chunk.min(src.len() - at);
        let last = (at + k == src.len()).then(|| aux(room, src.len()));
        r.send(at, &src[at..at + k], &p.src, last).await?;
        at += k;
    }
    assert_eq!(r.poll(Instant::now()), State::Success);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_rooms_arrive_bit_exact_over_rdma() {
    let p = pair(MemVerbs::new()).await;
    let mut rng = Rng(7);
    for round in 0..6u64 {
        let mut free_dst: Vec<u32> = (0..PAGES as u32).collect();
        let mut free_src: Vec<u32> = (0..PAGES as u32).collect();
        let n = 1 + rng.next(20) as usize;
        let mut dst = rng.pick(n, &mut free_dst);
        if rng.next(2) == 0 {
            dst.sort_unstable();
        }
        let mut src = rng.pick(n, &mut free_src);
        src.sort_unstable();
        let room = round + 1;
        let done = p.receiver.open(Room::new(room).expect("63 bits"), key(room), &dst).expect("open");
        let chunk = 1 + rng.next(6) as usize;
        send_room(&p, room, &src, &dst, chunk).await.expect("sent");
        match outcome(done).await {
            Outcome::Success(a) => assert_eq!(a.room_echo, room),
            other => panic!("room {room}: {other:?}"),
        }
        for (s, d) in src.iter().zip(&dst) {
            assert_eq!(page(&p.rx_mem, *d), page(&p.src, *s), "room {room}: page {s} -> {d}");
        }
        let id = Room::new(room).expect("63 bits");
        assert_eq!(p.receiver.poll(id), Some(State::Success));
        p.receiver.close(id);
    }
    assert_eq!(p.receiver.inbox().open_rooms(), (0, 0));
}

async fn faulty(fault: VerbsFault) -> (Result<(), FailReason>, Outcome, Pair) {
    let p = pair(MemVerbs::with_faults(vec![fault])).await;
    let dst: Vec<u32> = (20..32).collect();
    let src: Vec<u32> = (0..12).collect();
    let done = p.receiver.open(Room::from(5u32), RoomSecret::from([5; 16]), &dst).expect("open");
    let sent = send_room(&p, 5, &src, &dst, 4).await;
    (sent, outcome(done).await, p)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verbs_failures_fail_the_room_on_both_sides_with_a_reason() {
    // A write landing with a flipped byte: the receiver's checksum catches it.
    let (sent, o, p) = faulty(VerbsFault::CorruptAt(0)).await;
    assert!(sent.is_ok(), "the sender cannot tell: {sent:?}");
    assert!(matches!(o, Outcome::Failed(FailReason::Corrupt(_))), "{o:?}");
    p.receiver.close(Room::from(5u32));
    // A remote access error: the queue pair breaks, both sides see it.
    let (sent, o, _) = faulty(VerbsFault::FailAt(2)).await;
    assert!(matches!(sent, Err(FailReason::PeerGone(_))), "{sent:?}");
    assert!(matches!(o, Outcome::Failed(FailReason::PeerGone(_))), "{o:?}");
    // A disconnect mid-room.
    let (sent, o, _) = faulty(VerbsFault::DisconnectAt(3)).await;
    assert!(matches!(sent, Err(FailReason::PeerGone(_))), "{sent:?}");
    assert!(matches!(o, Outcome::Failed(FailReason::PeerGone(_))), "{o:?}");
    // A hung peer: the sender's wait times out; the receiver's room times out in Transferring
    // (its first chunk's headers arrived) or WaitingForInput.
    let (sent, o, _) = faulty(VerbsFault::StallAt(6)).await;
    assert!(matches!(sent, Err(FailReason::PeerGone(_))), "{sent:?}");
    assert!(matches!(o, Outcome::Failed(FailReason::Timeout(_))), "{o:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aborts_and_a_vanished_sender_free_the_room() {
    let p = pair(MemVerbs::new()).await;
    // Sender-side abort mid-room.
    let dst = [1, 2, 3];
    let done = p.receiver.open(Room::from(1u32), RoomSecret::from([1; 16]), &dst).expect("open");
    {
        let mut r = SendRoom::new(Room::from(1u32), RoomSecret::from([1; 16]), rcfg().timeouts, Instant::now());
        r.handshake(Arc::clone(&p.sender), dst.to_vec(), Instant::now()).expect("handshake");
        r.send(0, &[9], &p.src, None).await.expect("first chunk");
        r.abort("client went away").await;
        assert_eq!(r.poll(Instant::now()), State::Failed);
        match outcome(done).await {
            Outcome::Failed(FailReason::Aborted(why)) => assert_eq!(why, "client went away"),
            other => panic!("{other:?}"),
        }
        assert!(r.send(1, &[10], &p.src, None).await.is_err(), "a failed room sends nothing more");
    }
    p.receiver.close(Room::from(1u32));
    assert_eq!(p.receiver.inbox().open_rooms(), (0, 0));
    // The sender process goes away: its exchange socket closes, the receiver fails its rooms.
    let done = p.receiver.open(Room::from(2u32), RoomSecret::from([2; 16]), &dst).expect("reopen the same pages");
    let mut r = SendRoom::new(Room::from(2u32), RoomSecret::from([2; 16]), rcfg().timeouts, Instant::now());
    r.handshake(Arc::clone(&p.sender), dst.to_vec(), Instant::now()).expect("handshake");
    r.send(0, &[9], &p.src, None).await.expect("first chunk");
    let Pair { sender, receiver, .. } = p;
    drop(r);
    drop(sender);
    let o = outcome(done).await;
    assert!(matches!(o, Outcome::Failed(FailReason::PeerGone(_))), "{o:?}");
    receiver.close(Room::from(2u32));
    assert_eq!(receiver.inbox().open_rooms(), (0, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sender_room_states_and_timeouts() {
    let p = pair(MemVerbs::new()).await;
    let t0 = Instant::now();
    let t = rcfg().timeouts;
    let mut r = SendRoom::new(Room::from(3u32), RoomSecret::from([3; 16]), t, t0);
    assert!(r.send(0, &[1], &p.src, None).await.is_err(), "no send before the handshake");
    let mut r2 = SendRoom::new(Room::from(4u32), RoomSecret::from([4; 16]), t, t0);
    assert_eq!(r2.poll(t0 + t.bootstrap), State::Failed, "bootstrap times out");
    assert!(matches!(r2.reason(), Some(FailReason::Timeout(State::Bootstrapping))));
    r = SendRoom::new(Room::from(3u32), RoomSecret::from([3; 16]), t, t0);
    r.handshake(Arc::clone(&p.sender), vec![1, 2], t0).expect("handshake");
    assert_eq!(r.poll(t0 + t.waiting), State::Failed, "waiting for input times out");
    let mut r3 = SendRoom::new(Room::from(5u32), RoomSecret::from([5; 16]), t, t0);
    r3.handshake(Arc::clone(&p.sender), vec![1, 2], t0).expect("handshake");
    assert!(r3.send(1, &[1, 2], &p.src, None).await.is_err(), "slots past the destination list are refused");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_page_size_mismatch_is_refused_at_connect() {
    let verbs = Arc::new(MemVerbs::new());
    let rx_mem = Arc::new(HostPages::new(PAGE, PAGES).expect("arena"));
    let r = RdmaReceiver::bind(any_addr(), Arc::clone(&verbs), rx_mem, rcfg(), Security::Plain).await.expect("bind");
    let wrong = Arc::new(HostPages::new(PAGE * 2, 4).expect("arena"));
    let e = connect_for_a_room(&r, verbs, wrong).await.expect_err("mismatch");
    assert!(e.to_string().contains("page size mismatch"), "{e}");
}

/// The connection exchange hands out a queue pair, the arena's address and its remote key
/// only to a peer showing the key of a room open on the receiver, once: not to a peer without
/// one, with a wrong secret, with a key already used, for a closed room, or speaking something
/// else.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_connection_exchange_answers_only_a_live_rooms_key() {
    use ferry_transfer::table::Refusal;
    let verbs = Arc::new(MemVerbs::new());
    let (src, rx_mem) = (Arc::new(source()), Arc::new(HostPages::new(PAGE, PAGES).expect("arena")));
    let r = RdmaReceiver::bind(any_addr(), Arc::clone(&verbs), rx_mem, rcfg(), Security::Plain).await.expect("bind");
    let connect = |room: u32, secret: RoomSecret| {
        let (verbs, src, at) = (Arc::clone(&verbs), Arc::clone(&src), r.local_addr());
        async move { RdmaSender::connect(at, verbs, src, rcfg(), (Room::from(room), &secret), &Security::Plain).await }
    };
    let refused = |why: Refusal| r.inbox().refusals(why);

    let e = connect(7, key(7)).await.expect_err("no room open");
    assert!(e.to_string().contains("the receiver refused the key of"), "{e}");
    assert_eq!(refused(Refusal::UnknownRoom), 1);
    let _open = r.open(Room::from(7u32), key(7), &[1, 2]).expect("open");
    connect(7, key(8)).await.expect_err("a wrong secret");
    assert_eq!(refused(Refusal::WrongSecret), 1);
    // Something that is not a Ferry RDMA peer gets no answer at all.
    let mut raw = tokio::net::TcpStream::connect(r.local_addr()).await.expect("tcp");
    tokio::io::AsyncWriteExt::write_all(&mut raw, &[0u8; 64]).await.expect("write");
    let mut reply = Vec::new();
    let n = tokio::time::timeout(Duration::from_secs(5), tokio::io::AsyncReadExt::read_to_end(&mut raw, &mut reply))
        .await
        .expect("closed");
    assert_eq!((n.unwrap_or(0), reply.len()), (0, 0), "no bytes for a stranger");

    let s = connect(7, key(7)).await.expect("the room's key opens the exchange");
    assert_eq!(s.region().pages, PAGES as u64);
    connect(7, key(7)).await.expect_err("one key opens one exchange");
    assert_eq!(refused(Refusal::Closed), 1);
    r.close(Room::from(7u32));
    connect(7, key(7)).await.expect_err("a closed room's key");
    assert_eq!(refused(Refusal::UnknownRoom), 2);
}

/// A receiver on real ibverbs: in a build without the `rdma` feature, or on a machine with no
/// RDMA device, it is refused naming what is missing; with both, it opens and registers the
/// arena (on whichever machine this runs, the branch taken is asserted, not skipped).
#[tokio::test]
async fn a_real_rdma_receiver_opens_on_a_device_or_says_what_is_missing() {
    let mem = Arc::new(HostPages::new(PAGE, 4).expect("arena"));
    let got = ferry_transfer::backend::rdma_receiver(any_addr(), mem, rcfg(), Security::Plain).await;
    let devices = ferry_transfer::rdma::device_count();
    match (cfg!(feature = "rdma"), devices, got) {
        (false, _, Err(e)) => assert!(e.to_string().contains("--features rdma"), "{e}"),
        (true, 0, Err(e)) => assert!(e.to_string().contains("no RDMA device on this machine"), "{e}"),
        (true, _, Ok(r)) => assert!(r.local_addr().is_some(), "an rdma receiver listens for its connection exchange"),
        (built, n, got) => panic!("rdma built in: {built}, {n} devices: {:?}", got.err()),
    }
}

/// A peer speaking the protocol by hand, as a compromised prefill node would: it shows a
/// room's key, then posts its own WRITEs wherever it likes.
struct Rogue {
    qp: ferry_transfer::rdma::mem::MemQp,
    stream: ferry_transfer::secure::DataStream,
    region: ferry_transfer::rdma::cm::RemoteRegion,
    src: Arc<HostPages>,
    lkey: u32,
    next: u64,
}

impl Rogue {
    async fn connect(r: &RdmaReceiver<MemVerbs>, verbs: &Arc<MemVerbs>, room: u64) -> Self {
        use ferry_transfer::rdma::verbs::{QueuePair, Verbs};
        let mut qp = verbs.create_qp(8).expect("qp");
        let mut stream = Security::Plain.connect(r.local_addr()).await.expect("tcp");
        let id = Room::new(room).expect("63 bits");
        let (peer, region) =
            ferry_transfer::rdma::cm::hello(&mut stream, &qp.endpoint(), id, &key(room)).await.expect("exchange");
        qp.connect(&peer).expect("connect");
        let src = Arc::new(source());
        // SAFETY: the arena lives as long as the rogue (the test's fabric outlives both).
        let lkey = unsafe { verbs.register(src.base_ptr(), src.len_bytes()) }.expect("register").lkey;
        Self { qp, stream, region, src, lkey, next: 0 }
    }

    async fn grant(&mut self, room: u64) -> std::io::Result<Vec<ferry_transfer::rdma::cm::Window>> {
        ferry_transfer::rdma::cm::ask_grant(&mut self.stream, Room::new(room).expect("63 bits"), &key(room)).await
    }

    /// Writes its source page `from` over destination page `dst` under `rkey`; how it ended.
    async fn write(&mut self, from: u32, dst: u32, rkey: u32) -> ferry_transfer::rdma::verbs::WcStatus {
        use ferry_transfer::rdma::verbs::{QueuePair, Sge};
        self.next += 1;
        let sge =
            Sge { addr: self.src.base_ptr() as u64 + u64::from(from) * PAGE as u64, len: PAGE as u32, lkey: self.lkey };
        let remote = self.region.base + u64::from(dst) * self.region.page_bytes;
        // SAFETY: the source page stays unchanged until the completion below.
        unsafe { self.qp.post_write(self.next, sge, remote, rkey) }.expect("post");
        let mut got = Vec::new();
        for _ in 0..1000 {
            self.qp.poll(8, &mut got).expect("poll");
            if let Some(c) = got.iter().find(|c| c.wr_id == self.next) {
                return c.status;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        panic!("write {} never completed", self.next);
    }
}

/// Per-room memory windows: a sender writes only the pages of the rooms it was granted, on its
/// own queue pair, while they are open. Tested by a peer posting its own WRITEs: into its
/// room (lands), into another room's pages with its window's key (fails, lands nothing, fails
/// its room), with another connection's key (fails), after the room closed (fails); a grant is
/// given once per room; windows are gone when rooms end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_outside_its_rooms_pages_fails_and_never_lands() {
    use ferry_transfer::rdma::verbs::WcStatus;
    let verbs = Arc::new(MemVerbs::new());
    let rx_mem = Arc::new(HostPages::new(PAGE, PAGES).expect("arena"));
    let r = RdmaReceiver::bind(any_addr(), Arc::clone(&verbs), Arc::clone(&rx_mem), rcfg(), Security::Plain)
        .await
        .expect("bind");
    let open = |room: u64, pages: &[u32]| r.open(Room::new(room).expect("63 bits"), key(room), pages).expect("open");
    let (a, b, c, d) = (open(1, &[1, 2, 3, 7]), open(2, &[10, 11]), open(3, &[20]), open(4, &[30, 31]));
    let zero = vec![0u8; PAGE];

    let mut ra = Rogue::connect(&r, &verbs, 1).await;
    let wa = ra.grant(1).await.expect("room 1's grant");
    assert_eq!(wa.iter().map(|w| (w.first, w.pages)).collect::<Vec<_>>(), vec![(1, 3), (7, 1)], "a window per run");
    assert_eq!(ra.write(0, 2, wa[0].rkey).await, WcStatus::Success, "into its own room");
    assert_eq!(page(&rx_mem, 2), page(&ra.src, 0));
    assert_eq!(ra.write(0, 4, wa[0].rkey).await, WcStatus::RemoteAccess, "page 4 lies between its runs");
    assert_eq!(page(&rx_mem, 4), zero);
    assert!(matches!(outcome(a).await, Outcome::Failed(FailReason::PeerGone(_))), "a bad write fails its room");

    // Another connection, holding room 3's key: room 1's grant is not given twice, and room
    // 1's window key does not work from another queue pair.
    let mut rc = Rogue::connect(&r, &verbs, 3).await;
    rc.grant(1).await.expect_err("a room is granted once");
    let wc = rc.grant(3).await.expect("room 3's grant");
    assert_eq!(rc.write(5, 2, wa[0].rkey).await, WcStatus::RemoteAccess, "another queue pair's window");
    assert_eq!(page(&rx_mem, 2), page(&ra.src, 0), "unchanged");
    assert!(matches!(outcome(c).await, Outcome::Failed(FailReason::PeerGone(_))));
    drop(wc);

    // Room 4's window into room 2's pages: refused, nothing lands, room 2 goes on.
    let mut rd = Rogue::connect(&r, &verbs, 4).await;
    let wd = rd.grant(4).await.expect("room 4's grant");
    assert_eq!(rd.write(1, 10, wd[0].rkey).await, WcStatus::RemoteAccess, "another room's pages");
    assert_eq!(page(&rx_mem, 10), zero);
    assert!(matches!(outcome(d).await, Outcome::Failed(FailReason::PeerGone(_))));
    assert_eq!(r.inbox().state(Room::from(2u32)), Some(State::WaitingForInput), "room 2 is untouched");

    // A room closed while its sender may still write (a cancelled request): its pages stay
    // held and its windows open, so a late write lands where no one reads and breaks nothing;
    // after the transferring timeout (2 s here) the windows go and the pages are free.
    let mut rb = Rogue::connect(&r, &verbs, 2).await;
    let wb = rb.grant(2).await.expect("room 2's grant");
    r.close(Room::from(2u32));
    assert!(r.inbox().writing(Room::from(2u32)), "room 2's pages are held while its sender may write");
    assert_eq!(rb.write(1, 10, wb[0].rkey).await, WcStatus::Success, "a late write breaks nothing");
    let released = r.inbox().released(Room::from(2u32)).expect("a release to wait for");
    tokio::time::timeout(Duration::from_secs(10), released).await.expect("released after the timeout").expect("sent");
    assert_eq!(rb.write(1, 11, wb[0].rkey).await, WcStatus::RemoteAccess, "the windows went with the lease");
    assert_eq!(page(&rx_mem, 11), zero);
    drop(b);
    for room in [1u32, 3, 4] {
        r.close(Room::from(room));
    }
    eventually("every window invalidated", || verbs.windows() == 0 && r.granted_rooms() == 0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rooms_windows_end_with_the_room() {
    let verbs = MemVerbs::new();
    let p = pair(verbs.clone()).await;
    let (src, dst): (Vec<u32>, Vec<u32>) = ((0..6).collect(), vec![40, 41, 42, 50, 51, 60]);
    let done = p.receiver.open(Room::from(9u32), key(9), &dst).expect("open");
    send_room(&p, 9, &src, &dst, 2).await.expect("sent");
    assert!(matches!(outcome(done).await, Outcome::Success(_)));
    eventually("the room's three windows invalidated at its Done", || verbs.windows() == 0).await;
    p.receiver.close(Room::from(9u32));
}

/// A request cancelled on the decode node while its prefill node is still sending: the room
/// closes, its pages stay held until the sender ends it, and the queue pair that other rooms
/// share is not broken (a write into an invalidated window would break it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_room_closed_mid_transfer_breaks_no_other_room() {
    let verbs = MemVerbs::new();
    let p = pair(verbs.clone()).await;
    let (x, y) = (Room::from(20u32), Room::from(21u32));
    let dx = p.receiver.open(x, key(20), &[1, 2, 3, 4]).expect("open");
    let dy = p.receiver.open(y, key(21), &[10, 11]).expect("open");
    let mut sx = SendRoom::new(x, key(20), rcfg().timeouts, Instant::now());
    sx.handshake(Arc::clone(&p.sender), vec![1, 2, 3, 4], Instant::now()).expect("handshake");
    sx.send(0, &[5, 6], &p.src, None).await.expect("the first chunk");
    // The decode node gives up on x while the prefill node goes on.
    p.receiver.close(x);
    assert!(matches!(outcome(dx).await, Outcome::Failed(_)));
    let released = p.receiver.inbox().released(x).expect("x's pages are held while its sender may write");
    sx.send(2, &[7, 8], &p.src, Some(aux(20, 4))).await.expect("its writes land in held pages");
    tokio::time::timeout(Duration::from_secs(10), released).await.expect("x's pages released").expect("sent");
    // y, on the same queue pair, is unharmed.
    send_room(&p, 21, &[9, 10], &[10, 11], 2).await.expect("y sent");
    assert!(matches!(outcome(dy).await, Outcome::Success(_)));
    p.receiver.close(y);
    eventually("every window invalidated", || verbs.windows() == 0).await;
}
