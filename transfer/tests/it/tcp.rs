//! The tcp backend over real loopback sockets: bit-exact delivery into the right pages,
//! refusals, corruption, truncation, cuts, aborts — and nothing left behind.

use ferry_core::{Room, RoomSecret};
use std::sync::Arc;
use std::time::Duration;

use ferry_transfer::frame::{Aux, Header};
use ferry_transfer::memory::HostPages;
use ferry_transfer::room::FailReason;
use ferry_transfer::runs::coalesce;
use ferry_transfer::table::{Outcome, Refusal};
use ferry_transfer::tcp::{Fault, TcpConfig, TcpReceiver, TcpSender};

use super::common::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_rooms_arrive_bit_exact_in_the_right_pages() {
    let src = source();
    let rx_mem = Arc::new(HostPages::new(PAGE, PAGES).expect("arena"));
    let receiver = TcpReceiver::bind(any_addr(), Arc::clone(&rx_mem), cfg()).await.expect("bind");
    let sender = TcpSender::connect(receiver.local_addr(), cfg()).await.expect("connect");
    let mut rng = Rng(99);
    for round in 0..5u64 {
        // A clean arena each round, so that the untouched-page check below means something.
        for p in 0..PAGES as u32 {
            // SAFETY: no room is open; nothing else writes the arena.
            unsafe { rx_mem.write(p, &[0; PAGE]).expect("zero") };
        }
        let mut free_dst: Vec<u32> = (0..PAGES as u32).collect();
        let mut free_src: Vec<u32> = (0..PAGES as u32).collect();
        let mut rooms = Vec::new();
        for r in 0..3u64 {
            let n = 1 + rng.next(12) as usize;
            // Mostly consecutive destinations (as a fresh allocation is), sometimes scattered.
            let mut dst = rng.pick(n, &mut free_dst);
            if rng.next(2) == 0 {
                dst.sort_unstable();
            }
            let mut srcp = rng.pick(n, &mut free_src);
            srcp.sort_unstable();
            let room = round * 10 + r + 1;
            let secret = RoomSecret::from([room as u8; 16]);
            let done = receiver.open(Room::new(room).expect("63 bits"), secret, &dst).expect("open");
            rooms.push((room, secret, srcp, dst, done));
        }
        let sends = rooms.iter().map(|(room, secret, srcp, dst, _)| {
            let (sender, src) = (&sender, &src);
            async move {
                // Send in chunks, as prefill produces them.
                let mut at = 0;
                let mut rng = Rng(*room * 7 + 3);
                while at < srcp.len() {
                    let k = (1 + rng.next(4) as usize).min(srcp.len() - at);
                    let runs = coalesce(&srcp[at..at + k], &dst[at..at + k]);
                    sender.send_pages(Room::new(*room).expect("63 bits"), *secret, &runs, src).await.expect("send");
                    at += k;
                }
                let aux =
                    Aux { first_token: *room as u32, logprob: -1.5, room_echo: *room, total_pages: dst.len() as u32 };
                sender.send_done(Room::new(*room).expect("63 bits"), *secret, aux).await.expect("done");
            }
        });
        futures::future::join_all(sends).await;
        for (room, _, srcp, dst, done) in rooms {
            match outcome(done).await {
                Outcome::Success(aux) => assert_eq!(aux.first_token, room as u32),
                other => panic!("room {room}: {other:?}"),
            }
            for (s, d) in srcp.iter().zip(&dst) {
                assert_eq!(page(&rx_mem, *d), page(&src, *s), "room {room}: page {s} → {d}");
            }
            receiver.close(Room::new(room).expect("63 bits"));
        }
        for &p in &free_dst {
            assert!(page(&rx_mem, p).iter().all(|&b| b == 0), "round {round}: untouched page {p} written");
        }
    }
    assert_eq!(receiver.open_rooms(), (0, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn foreign_frames_are_refused_counted_and_write_nothing() {
    let src = source();
    let rx_mem = Arc::new(HostPages::new(PAGE, PAGES).expect("arena"));
    let receiver = TcpReceiver::bind(any_addr(), Arc::clone(&rx_mem), cfg()).await.expect("bind");
    let sender =
        TcpSender::connect(receiver.local_addr(), TcpConfig { connections: 1, ..cfg() }).await.expect("connect");
    let done = receiver.open(Room::from(7u32), RoomSecret::from([7; 16]), &[10, 11]).expect("open");
    let run = |src: u32, dst: u32| coalesce(&[src], &[dst]);
    // Refused frames aim at pages nothing else writes, so a write would show.
    sender.send_pages(Room::from(8u32), RoomSecret::from([7; 16]), &run(1, 20), &src).await.expect("unknown room");
    sender.send_pages(Room::from(7u32), RoomSecret::from([0; 16]), &run(1, 21), &src).await.expect("wrong secret");
    sender.send_pages(Room::from(7u32), RoomSecret::from([7; 16]), &run(1, 12), &src).await.expect("outside the room");
    // The connection still works: the real pages go through afterwards.
    sender
        .send_pages(Room::from(7u32), RoomSecret::from([7; 16]), &coalesce(&[3, 4], &[10, 11]), &src)
        .await
        .expect("send");
    // A duplicate with other bytes than the page holds: a write would show.
    sender.send_pages(Room::from(7u32), RoomSecret::from([7; 16]), &run(5, 10), &src).await.expect("duplicate");
    sender
        .send_done(
            Room::from(7u32),
            RoomSecret::from([7; 16]),
            Aux { first_token: 1, logprob: 0.0, room_echo: 7, total_pages: 2 },
        )
        .await
        .expect("done");
    assert!(matches!(outcome(done).await, Outcome::Success(_)));
    for (r, n) in [(Refusal::UnknownRoom, 1), (Refusal::WrongSecret, 1), (Refusal::OutsideRoom, 1)] {
        assert_eq!(receiver.refusals(r), n, "{r:?}");
    }
    // The duplicate is refused, as a duplicate or, once the room succeeded, as closed.
    eventually("the duplicate's refusal", || {
        receiver.refusals(Refusal::Duplicate) + receiver.refusals(Refusal::Closed) == 1
    })
    .await;
    for p in [12, 20, 21] {
        assert!(page(&rx_mem, p).iter().all(|&b| b == 0), "refused frame wrote page {p}");
    }
    assert_eq!(page(&rx_mem, 10), page(&src, 3));
    receiver.close(Room::from(7u32));
    // Frames for a closed room are refused too.
    sender.send_pages(Room::from(7u32), RoomSecret::from([7; 16]), &run(1, 10), &src).await.expect("late frame");
    eventually("the late frame's refusal", || receiver.refusals(Refusal::UnknownRoom) == 2).await;
    assert_eq!(page(&rx_mem, 10), page(&src, 3), "late frame wrote nothing");
}

async fn faulty_room(fault: Fault, nth: u64) -> (Outcome, TcpReceiver) {
    let src = source();
    let rx_mem = Arc::new(HostPages::new(PAGE, PAGES).expect("arena"));
    let receiver = TcpReceiver::bind(any_addr(), rx_mem, cfg()).await.expect("bind");
    let filter = Arc::new(move |i: u64, _: &Header| if i == nth { fault } else { Fault::Pass });
    let sender = TcpSender::connect_with_faults(receiver.local_addr(), TcpConfig { connections: 1, ..cfg() }, filter)
        .await
        .expect("connect");
    let dst: Vec<u32> = (20..28).collect();
    let done = receiver.open(Room::from(5u32), RoomSecret::from([5; 16]), &dst).expect("open");
    let srcp: Vec<u32> = (0..8).collect();
    let _ = sender.send_pages(Room::from(5u32), RoomSecret::from([5; 16]), &coalesce(&srcp, &dst), &src).await;
    let _ = sender
        .send_done(
            Room::from(5u32),
            RoomSecret::from([5; 16]),
            Aux { first_token: 0, logprob: 0.0, room_echo: 5, total_pages: 8 },
        )
        .await;
    (outcome(done).await, receiver)
}

/// `send_done` returns once the receiver holds the room whole (its acknowledgement), and
/// fails, within the transferring timeout, for a room whose pages never arrived: a frame lost
/// with a connection no longer counts as sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn send_done_waits_for_the_receivers_acknowledgement() {
    let src = source();
    let rx_mem = Arc::new(HostPages::new(PAGE, PAGES).expect("arena"));
    let receiver = TcpReceiver::bind(any_addr(), rx_mem, cfg()).await.expect("bind");
    // The first frame is dropped on the floor: the room can never complete.
    let filter = Arc::new(|i: u64, _: &Header| if i == 0 { Fault::Drop } else { Fault::Pass });
    let sender = TcpSender::connect_with_faults(receiver.local_addr(), cfg(), filter).await.expect("connect");
    let aux = |room| Aux { first_token: 1, logprob: 0.0, room_echo: room, total_pages: 4 };
    let (lost, whole) = (Room::from(11u32), Room::from(12u32));
    let secret = RoomSecret::from([3; 16]);
    let srcp: Vec<u32> = (0..4).collect();
    for (room, dst) in [(lost, 30..34u32), (whole, 40..44u32)] {
        let dst: Vec<u32> = dst.collect();
        receiver.open(room, secret, &dst).expect("open");
        sender.send_pages(room, secret, &coalesce(&srcp, &dst), &src).await.expect("written");
    }
    sender.send_done(whole, secret, aux(12)).await.expect("acknowledged");
    assert_eq!(receiver.inbox().state(whole), Some(ferry_transfer::room::State::Success), "whole when acknowledged");
    let t = std::time::Instant::now();
    let e = sender.send_done(lost, secret, aux(11)).await.expect_err("a page was lost");
    assert_eq!(e.kind(), std::io::ErrorKind::TimedOut, "{e}");
    assert!(t.elapsed() >= cfg().timeouts.transferring, "waited for the acknowledgement: {:?}", t.elapsed());
}

/// A connection that ends after the room's last frame, unacknowledged (a partition cut it),
/// fails `send_done` at once, not after the transferring timeout: the receiver fails the rooms a
/// closed connection carried, so no acknowledgement can come. A chaos run had the router see
/// such rooms only when their 10 s timeouts ran out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_that_ends_unacknowledged_fails_send_done_at_once() {
    let src = source();
    let listener = tokio::net::TcpListener::bind(any_addr()).await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    // Reads what comes for a moment, then closes: no acknowledgement ever.
    let peer = tokio::spawn(async move {
        let (mut s, _) = listener.accept().await.expect("accept");
        let mut buf = vec![0u8; 1 << 16];
        let until = tokio::time::Instant::now() + Duration::from_millis(300);
        while let Ok(Ok(n)) = tokio::time::timeout_at(until, tokio::io::AsyncReadExt::read(&mut s, &mut buf)).await {
            if n == 0 {
                break;
            }
        }
    });
    let s = Duration::from_secs(120);
    let slow = TcpConfig {
        connections: 1,
        timeouts: ferry_transfer::room::Timeouts { transferring: s, ..cfg().timeouts },
        ..cfg()
    };
    let sender = TcpSender::connect(addr, slow).await.expect("connect");
    let (room, secret) = (Room::from(21u32), RoomSecret::from([4; 16]));
    let srcp: Vec<u32> = (0..4).collect();
    sender.send_pages(room, secret, &coalesce(&srcp, &[8, 9, 10, 11]), &src).await.expect("written");
    let aux = Aux { first_token: 1, logprob: 0.0, room_echo: 21, total_pages: 4 };
    let done = tokio::time::timeout(Duration::from_secs(60), sender.send_done(room, secret, aux)).await;
    let e = done.expect("send_done ends with the connection, not the 120 s timeout").expect_err("never acknowledged");
    assert_eq!(e.kind(), std::io::ErrorKind::BrokenPipe, "{e}");
    peer.await.expect("peer");
    assert!(sender.closed(), "the sender knows its connection ended");
    // A later room on the broken sender fails at its first send.
    let e = sender.send_pages(Room::from(22u32), secret, &coalesce(&srcp, &[8, 9, 10, 11]), &src).await;
    assert_eq!(e.expect_err("a dead connection").kind(), std::io::ErrorKind::BrokenPipe);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn corrupt_truncated_cut_and_dropped_frames_fail_the_room_with_a_reason() {
    let (o, _) = faulty_room(Fault::Corrupt(17), 1).await;
    assert!(matches!(o, Outcome::Failed(FailReason::Corrupt(_))), "{o:?}");
    let (o, _) = faulty_room(Fault::Truncate(100), 1).await;
    assert!(matches!(o, Outcome::Failed(FailReason::PeerGone(_))), "{o:?}");
    let (o, _) = faulty_room(Fault::Cut, 1).await;
    assert!(matches!(o, Outcome::Failed(FailReason::PeerGone(_))), "{o:?}");
    // A dropped frame leaves a page missing: the room waits, then times out in Transferring.
    let (o, _) = faulty_room(Fault::Drop, 0).await;
    assert!(matches!(o, Outcome::Failed(FailReason::Timeout(_))), "{o:?}");
    // Delay and reorder are harmless.
    let (o, _) = faulty_room(Fault::Delay(Duration::from_millis(50)), 0).await;
    assert!(matches!(o, Outcome::Success(_)), "{o:?}");
    let (o, receiver) = faulty_room(Fault::Reorder, 0).await;
    assert!(matches!(o, Outcome::Success(_)), "{o:?}");
    receiver.close(Room::from(5u32));
    assert_eq!(receiver.open_rooms(), (0, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aborts_from_either_side_end_the_room_and_free_its_pages() {
    let src = source();
    let rx_mem = Arc::new(HostPages::new(PAGE, PAGES).expect("arena"));
    let receiver = TcpReceiver::bind(any_addr(), rx_mem, cfg()).await.expect("bind");
    let sender = TcpSender::connect(receiver.local_addr(), cfg()).await.expect("connect");
    let done = receiver.open(Room::from(1u32), RoomSecret::from([1; 16]), &[1, 2, 3]).expect("open");
    sender.send_pages(Room::from(1u32), RoomSecret::from([1; 16]), &coalesce(&[5], &[1]), &src).await.expect("send");
    sender.send_abort(Room::from(1u32), RoomSecret::from([1; 16]), "client went away").await.expect("abort");
    match outcome(done).await {
        Outcome::Failed(FailReason::Aborted(why)) => assert_eq!(why, "client went away"),
        other => panic!("{other:?}"),
    }
    receiver.close(Room::from(1u32));
    // Receiver side: close mid-transfer; the sender's later frames are refused.
    let done = receiver.open(Room::from(2u32), RoomSecret::from([2; 16]), &[1, 2, 3]).expect("reopen the same pages");
    sender.send_pages(Room::from(2u32), RoomSecret::from([2; 16]), &coalesce(&[5], &[1]), &src).await.expect("send");
    receiver.close(Room::from(2u32));
    assert!(matches!(outcome(done).await, Outcome::Failed(FailReason::Aborted(_))));
    sender.send_pages(Room::from(2u32), RoomSecret::from([2; 16]), &coalesce(&[6], &[2]), &src).await.expect("late");
    eventually("the late frame's refusal", || receiver.refusals(Refusal::UnknownRoom) >= 1).await;
    assert_eq!(receiver.open_rooms(), (0, 0));
}

/// A sender that stops mid-payload and never closes (a frozen or partitioned prefill host):
/// the room fails, and once the receiver closes it its pages come back within the progress
/// timeout, instead of staying claimed by a read that never ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sender_stalled_mid_frame_releases_the_rooms_pages_within_the_progress_timeout() {
    use tokio::io::AsyncWriteExt;
    let rx_mem = Arc::new(HostPages::new(PAGE, PAGES).expect("arena"));
    let receiver = TcpReceiver::bind(any_addr(), rx_mem, cfg()).await.expect("bind");
    let done = receiver.open(Room::from(3u32), RoomSecret::from([3; 16]), &[10, 11]).expect("open");
    let payload = vec![7u8; PAGE];
    let mut raw = tokio::net::TcpStream::connect(receiver.local_addr()).await.expect("connect");
    raw.write_all(&Header::pages(Room::from(3u32), RoomSecret::from([3; 16]), 10, 1, &payload).encode())
        .await
        .expect("header");
    raw.write_all(&payload[..PAGE / 2]).await.expect("half the payload");
    let t = std::time::Instant::now();
    assert!(matches!(outcome(done).await, Outcome::Failed(_)));
    receiver.close(Room::from(3u32));
    // cfg(): transfers time out after 2 s without progress.
    eventually("the stalled run's pages released", || !receiver.inbox().writing(Room::from(3u32))).await;
    assert!(t.elapsed() < Duration::from_secs(5), "took {:?}", t.elapsed());
    assert_eq!(receiver.open_rooms(), (0, 0));
    receiver.open(Room::from(4u32), RoomSecret::from([4; 16]), &[10, 11]).expect("the pages can be handed out again");
    // The stalled connection was dropped: its late bytes land nowhere.
    let _ = raw.write_all(&payload[PAGE / 2..]).await;
    drop(raw);
}

/// Delta transfer through `SendRoom`: the receiver holds the room's first slots already, its
/// destination list starts after them, and chunks' slots below them are skipped — a chunk all
/// inside them sends nothing; the rest land where the list says.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_room_whose_first_slots_the_receiver_holds_sends_only_the_rest() {
    use ferry_transfer::room::State;
    use ferry_transfer::{SendRoom, Sender};
    use std::time::Instant;
    let src = source();
    let rx_mem = Arc::new(HostPages::new(PAGE, PAGES).expect("arena"));
    let receiver = TcpReceiver::bind(any_addr(), Arc::clone(&rx_mem), cfg()).await.expect("bind");
    let sender = Arc::new(Sender::Tcp(TcpSender::connect(receiver.local_addr(), cfg()).await.expect("connect")));
    let (room, secret) = (Room::from(77u32), RoomSecret::from([77; 16]));
    // Slots 0..3 held; slots 3..6 go to pages 40, 41, 50.
    let dest = vec![40, 41, 50];
    let done = receiver.open(room, secret, &dest).expect("open");
    let mut r = SendRoom::new(room, secret, cfg().timeouts, Instant::now());
    r.handshake_held(Arc::clone(&sender), dest, 3, Instant::now()).expect("handshake");
    r.send(0, &[1, 2], &src, None).await.expect("a chunk of held slots: nothing to send");
    r.send(2, &[3, 4, 5], &src, None).await.expect("slot 2 held, 3 and 4 sent");
    // The room's 6 slots, as a prefill node counts them; the receiver was sent 3.
    let aux = Aux { first_token: 9, logprob: 0.0, room_echo: 77, total_pages: 6 };
    r.send(5, &[6], &src, Some(aux)).await.expect("the last slot");
    assert_eq!(r.poll(Instant::now()), State::Success);
    assert!(matches!(outcome(done).await, Outcome::Success(_)));
    for (s, d) in [(4, 40), (5, 41), (6, 50)] {
        assert_eq!(page(&rx_mem, d), page(&src, s), "source page {s} -> {d}");
    }
    receiver.close(room);
    let mut r = SendRoom::new(Room::from(78u32), RoomSecret::from([78; 16]), cfg().timeouts, Instant::now());
    r.handshake_held(Arc::clone(&sender), vec![60], 1, Instant::now()).expect("handshake");
    assert!(r.send(1, &[1, 2], &src, None).await.is_err(), "slots past the room are refused");
}
