//! Every metric name Ferry emits, in one place (DESIGN.md §8), with its help text and labels.
//! Code records through the `metrics` facade using these constants; [`describe`] registers the
//! help texts with whichever recorder (the Prometheus exporter) is installed.

/// Bytes of KV pages moved, by `backend` (counter).
pub const TRANSFER_BYTES: &str = "ferry_transfer_bytes_total";
/// Page runs moved, by `backend` (counter).
pub const TRANSFER_RUNS: &str = "ferry_transfer_runs_total";
/// Seconds one chunk's send took, from the first byte posted to the last acknowledged,
/// by `backend` (histogram).
pub const TRANSFER_CHUNK_SECONDS: &str = "ferry_transfer_chunk_seconds";
/// Throughput of the last chunk sent, bytes per second, by `backend` (gauge).
pub const TRANSFER_THROUGHPUT: &str = "ferry_transfer_throughput_bytes_per_second";
/// Rooms ended, by `backend`, `side` (sender | receiver), `outcome` (success | failed) and
/// `reason` (none | timeout | aborted | corrupt | peer_gone | refused) (counter).
pub const TRANSFER_ROOMS: &str = "ferry_transfer_rooms_total";
/// Frames or rooms a receiver refused, by `reason` (counter).
pub const TRANSFER_REFUSALS: &str = "ferry_transfer_refusals_total";
/// The transfer backend in use: 1 for the `backend` chosen, with the `requested` one (gauge).
pub const TRANSFER_BACKEND: &str = "ferry_transfer_backend";

/// Registers help texts for every metric with the installed recorder.
pub fn describe() {
    use metrics::{describe_counter, describe_gauge, describe_histogram};
    describe_counter!(TRANSFER_BYTES, metrics::Unit::Bytes, "KV page bytes moved, by backend");
    describe_counter!(TRANSFER_RUNS, "KV page runs moved, by backend");
    describe_histogram!(TRANSFER_CHUNK_SECONDS, metrics::Unit::Seconds, "Time to send one chunk's pages, by backend");
    describe_gauge!(TRANSFER_THROUGHPUT, "Bytes per second of the last chunk sent, by backend");
    describe_counter!(TRANSFER_ROOMS, "Transfer rooms ended, by backend, side, outcome and reason");
    describe_counter!(TRANSFER_REFUSALS, "Frames or rooms refused by a receiver, by reason");
    describe_gauge!(TRANSFER_BACKEND, "Transfer backend in use (1), with the one requested");
}
