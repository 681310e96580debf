//! An OTLP/gRPC trace collector that counts the spans it is sent and forgets them, for
//! `scripts/bench-tracing`: `otlp-sink 127.0.0.1:4317` serves until interrupted, printing
//! the count every 5 s and at the end.

use std::time::Duration;

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let addr = std::env::args().nth(1).unwrap_or_else(|| "127.0.0.1:4317".into());
    let (sink, at) = ferry_tests::otlp::Collector::serve(&addr, false).await;
    println!("otlp-sink: listening on {at}");
    let mut tick = tokio::time::interval(Duration::from_secs(5));
    loop {
        tokio::select! {
            _ = tick.tick() => println!("otlp-sink: {} spans", sink.count()),
            _ = tokio::signal::ctrl_c() => break,
        }
    }
    println!("otlp-sink: {} spans in all", sink.count());
}
