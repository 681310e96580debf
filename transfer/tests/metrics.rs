//! Transfer metrics, read back through the Prometheus exporter. Its own test binary: the
//! recorder is process-global, and exact counts need no other test moving bytes meanwhile.

use ferry_core::{Room, RoomSecret};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ferry_transfer::fake::FakeReceiver;
use ferry_transfer::frame::Aux;
use ferry_transfer::memory::HostPages;
use ferry_transfer::room::Timeouts;
use ferry_transfer::table::Outcome;
use ferry_transfer::{Receiver, SendRoom, Sender};

/// The value of the sample of `name` whose labels contain every one of `labels` (0 if none).
fn sample(text: &str, name: &str, labels: &[&str]) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(name) && labels.iter().all(|x| l.contains(x)))
        .find_map(|l| l.rsplit(' ').next()?.parse().ok())
        .unwrap_or(0.0)
}

#[tokio::test]
async fn transfers_are_measured_per_backend_outcome_and_refusal() {
    let rec = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
    let h = rec.handle();
    metrics::set_global_recorder(rec).expect("the only recorder in this binary");
    ferry_core::metrics::describe();

    let page = 512;
    let mem = HostPages::new(page, 8).expect("arena");
    let fake = FakeReceiver::new(Timeouts::default());
    let sender = Arc::new(Sender::Fake(fake.sender()));
    let receiver = Receiver::Fake(fake);
    let dst = [5, 6, 7];
    let done = receiver.open(Room::from(1u32), RoomSecret::from([1; 16]), &dst).expect("open");
    let mut room = SendRoom::new(Room::from(1u32), RoomSecret::from([1; 16]), Timeouts::default(), Instant::now());
    room.handshake(Arc::clone(&sender), dst.to_vec(), Instant::now()).expect("handshake");
    room.send(0, &[0, 1], &mem, None).await.expect("chunk 1");
    let aux = Aux { first_token: 9, logprob: 0.0, room_echo: 1, total_pages: 3 };
    room.send(2, &[4], &mem, Some(aux)).await.expect("chunk 2");
    assert!(matches!(done.await, Ok(Outcome::Success(_))));
    assert!(receiver.open(Room::from(1u32), RoomSecret::from([1; 16]), &[0]).is_err(), "a duplicate room is refused");
    receiver.close(Room::from(1u32));
    let mut late = SendRoom::new(
        Room::from(2u32),
        RoomSecret::from([2; 16]),
        Timeouts { bootstrap: Duration::ZERO, ..Timeouts::default() },
        Instant::now(),
    );
    late.poll(Instant::now());
    ferry_transfer::backend::choose(
        ferry_transfer::BackendKind::Auto,
        Err(ferry_transfer::rdma::verbs::VerbsError::NotBuilt),
    )
    .expect("auto falls back");

    let t = h.render();
    let fake = r#"backend="fake""#;
    assert_eq!(sample(&t, "ferry_transfer_bytes_total", &[fake]), (3 * page) as f64);
    assert_eq!(sample(&t, "ferry_transfer_runs_total", &[fake]), 2.0, "[0,1]->[5,6] and [4]->[7]");
    assert_eq!(sample(&t, "ferry_transfer_chunk_seconds_count", &[fake]), 2.0);
    for side in [r#"side="sender""#, r#"side="receiver""#] {
        let labels = [fake, side, r#"outcome="success""#];
        assert_eq!(sample(&t, "ferry_transfer_rooms_total", &labels), 1.0, "{side}");
    }
    let timeout = [r#"side="sender""#, r#"outcome="failed""#, r#"reason="timeout""#];
    assert_eq!(sample(&t, "ferry_transfer_rooms_total", &timeout), 1.0, "the bootstrap timeout");
    assert_eq!(sample(&t, "ferry_transfer_refusals_total", &[r#"reason="duplicate_room""#]), 1.0);
    assert_eq!(sample(&t, "ferry_transfer_backend", &[r#"backend="tcp""#, r#"requested="auto""#]), 1.0);
    assert!(t.contains("# HELP ferry_transfer_bytes_total"), "help texts registered");
}
