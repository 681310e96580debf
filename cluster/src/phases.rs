//! Where a request's time goes: each daemon splits its part of every request into phases and
//! records each in `ferry_request_phase_seconds{role, phase}` (a histogram), so an operator
//! can tell queueing from compute from transfer.
//!
//! | role | phase | from → to |
//! |---|---|---|
//! | router | `tokenize` | request received → parsed and tokenized |
//! | router | `queue` | admission asked → a slot given |
//! | router | `placement` | slot given → workers chosen (prefix match, load, provisional insert) |
//! | router | `first_token` | workers chosen → first token streamed (all of prefill, transfer, decode admission) |
//! | router | `decode` | first token → last token |
//! | prefill | `prefill_queue` | request and handshake both here → first chunk scheduled |
//! | prefill | `prefill_compute` | first chunk scheduled → last chunk computed |
//! | prefill | `transfer` | last chunk computed → every page acknowledged |
//! | decode | `admission` | request accepted (or retracted) → its pages allocated |
//! | decode | `transfer` | pages allocated → the prompt's KV arrived |
//! | decode | `local_prefill` | pages allocated → the prompt computed here |
//! | decode | `first_token` | KV complete → first token emitted |
//! | decode | `retracted` | pages allocated → retracted before its first token (work lost) |
//! | decode | `decode` | first token → the request ends |
//!
//! A request retracted on the decode node records its decoding up to the retraction as one
//! `decode`, its wait for pages again as another `admission`, and the rest as a last
//! `decode`.
//!
//! Each daemon also keeps a request's laps ([`PhaseClock::laps`]) and sends them on with its
//! answer (prefill in `PrefillResponse.phases`; decode on the `DecodeResponse` of its first
//! token, so far, and on its last, all of them); the
//! router joins the three into the request's critical path ([`breakdown`]), which a client
//! gets on asking: the `ferry-phases: 1` HTTP header, or `return_phases` over gRPC (the last
//! message's `phases` and the `ferry-phases` trailer).

use std::time::Instant;

/// One phase of one request: its name and seconds.
pub type Lap = (&'static str, f64);

/// A request's clock on one daemon: each [`lap`](Self::lap) records the time since the
/// previous boundary as one phase, in the histogram and in the request's own record
/// ([`laps`](Self::laps)), which the daemon sends on with the request's answer.
#[derive(Debug, Clone)]
pub struct PhaseClock {
    role: &'static str,
    at: Instant,
    laps: Vec<Lap>,
}

impl PhaseClock {
    /// A clock for `role` whose first phase starts at `now`.
    pub fn start(role: &'static str, now: Instant) -> Self {
        Self { role, at: now, laps: Vec::with_capacity(6) }
    }

    /// Records `phase` as lasting from the last boundary to `now`, and starts the next one.
    pub fn lap(&mut self, phase: &'static str, now: Instant) {
        let d = now.saturating_duration_since(self.at).as_secs_f64();
        metrics::histogram!(crate::metrics::REQUEST_PHASE, "role" => self.role, "phase" => phase).record(d);
        self.laps.push((phase, d));
        self.at = now;
    }

    /// The phases recorded so far, in order.
    pub fn laps(&self) -> &[Lap] {
        &self.laps
    }
}

/// The phases of [`breakdown`], in order (what `ferry bench` reports and `ferry-phases`
/// carries):
///
/// | phase | what |
/// |---|---|
/// | `tokenize` | router: parsing and tokenizing the body (OpenAI API) |
/// | `queue` | router: waiting for admission |
/// | `placement` | router: choosing the workers |
/// | `decode_admission` | decode: waiting for KV pages |
/// | `prefill_queue` | prefill: waiting to be scheduled |
/// | `prefill_compute` | prefill: computing the prompt |
/// | `transfer` | decode: waiting for the KV pages after prefill computed them (the last chunk's transfer, the handshake) |
/// | `local_prefill` | decode: computing the prompt itself (short prompts, no prefill worker) |
/// | `first_decode_step` | decode: KV complete → first token |
/// | `other` | router: the rest of the time to the first token (calls between the daemons, failed attempts) |
/// | `decode` | router: first token → last token, less `readmission` |
/// | `readmission` | decode: a retracted request's waits for pages again (and, retracted before its first token, the work lost) |
pub const BREAKDOWN: [&str; 12] = [
    "tokenize",
    "queue",
    "placement",
    "decode_admission",
    "prefill_queue",
    "prefill_compute",
    "transfer",
    "local_prefill",
    "first_decode_step",
    "other",
    "decode",
    "readmission",
];

/// The phases as one header or metadata value, in order: `tokenize=0.000120, queue=...`
/// (seconds): the HTTP `ferry-phases` response header and the gRPC `ferry-phases` trailer.
pub fn header_value(phases: &[(&str, f64)]) -> String {
    phases.iter().map(|(p, s)| format!("{p}={s:.6}")).collect::<Vec<_>>().join(", ")
}

fn sum<S: AsRef<str>>(laps: &[(S, f64)], phase: &str) -> f64 {
    // + 0.0: an empty sum is -0.0, which JSON would show as such.
    laps.iter().filter(|(p, _)| p.as_ref() == phase).map(|(_, s)| s).sum::<f64>() + 0.0
}

/// One request's critical path, phase by phase ([`BREAKDOWN`]'s order), from the router's,
/// the prefill worker's and the decode worker's laps. Prefill and decode overlap (decode
/// waits for the KV while prefill computes it), so the decode worker's wait for the KV is
/// split into what prefill spent queued and computing and the rest (`transfer`); the
/// router's wait for the first token beyond what decode accounts for is `other`. Without
/// clamping (a worker's phase longer than the router saw, on a clock running slow), the
/// phases sum to the router's time for the request.
pub fn breakdown<S: AsRef<str>, T: AsRef<str>>(
    router: &[Lap],
    prefill: &[(S, f64)],
    decode: &[(T, f64)],
) -> [(&'static str, f64); 12] {
    // Decode's laps up to its first token, and after (a retracted request's waits again).
    let first = decode.iter().position(|(p, _)| matches!(p.as_ref(), "first_token" | "local_prefill"));
    let (before, after) = decode.split_at(first.map_or(decode.len(), |i| i + 1));
    let admission = before.iter().find(|(p, _)| p.as_ref() == "admission").map_or(0.0, |(_, s)| *s);
    // Retracted before its first token: the work lost and the wait for pages again.
    let again_before = (sum(before, "admission") - admission + sum(before, "retracted")).max(0.0);
    let (kv_wait, local, first_step) =
        (sum(before, "transfer"), sum(before, "local_prefill"), sum(before, "first_token"));
    let (queued, computed) = (sum(prefill, "prefill_queue"), sum(prefill, "prefill_compute"));
    // Decode waited for the KV while prefill queued and computed it; without decode's wait
    // (its laps missing), prefill's own phases stand in for it.
    let (transfer, kv_side) =
        if kv_wait > 0.0 { ((kv_wait - queued - computed).max(0.0), kv_wait) } else { (0.0, queued + computed) };
    let accounted = admission + again_before + kv_side + local + first_step;
    let again_after = sum(after, "admission");
    [
        ("tokenize", sum(router, "tokenize")),
        ("queue", sum(router, "queue")),
        ("placement", sum(router, "placement")),
        ("decode_admission", admission),
        ("prefill_queue", queued),
        ("prefill_compute", computed),
        ("transfer", transfer),
        ("local_prefill", local),
        ("first_decode_step", first_step),
        ("other", (sum(router, "first_token") - accounted).max(0.0)),
        ("decode", (sum(router, "decode") - again_after).max(0.0)),
        ("readmission", again_before + again_after),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    const ROUTER: [Lap; 5] =
        [("tokenize", 0.001), ("queue", 0.002), ("placement", 0.0005), ("first_token", 1.0), ("decode", 2.0)];

    fn get(b: &[(&str, f64)], phase: &str) -> f64 {
        b.iter().find(|(q, _)| *q == phase).expect("the phase").1
    }

    fn sums_to_the_routers_time(b: &[(&str, f64)]) {
        let (total, router): (f64, f64) = (b.iter().map(|(_, s)| s).sum(), ROUTER.iter().map(|(_, s)| s).sum());
        assert!((total - router).abs() < 1e-9, "{b:?}");
    }

    #[test]
    fn a_disaggregated_request_splits_decodes_wait_for_the_kv_and_sums_to_the_routers_time() {
        let prefill = [("prefill_queue", 0.2), ("prefill_compute", 0.5), ("transfer", 0.05)];
        let decode = [("admission", 0.1), ("transfer", 0.8), ("first_token", 0.02), ("decode", 2.0)];
        let b = breakdown(&ROUTER, &prefill, &decode);
        assert_eq!(b.map(|(p, _)| p), BREAKDOWN);
        let get = |p: &str| get(&b, p);
        assert!((get("transfer") - 0.1).abs() < 1e-9, "{b:?}");
        assert!((get("other") - 0.08).abs() < 1e-9, "{b:?}");
        assert_eq!((get("decode_admission"), get("prefill_compute"), get("local_prefill")), (0.1, 0.5, 0.0));
        sums_to_the_routers_time(&b);
    }

    #[test]
    fn a_retracted_request_shows_its_second_wait_for_pages_apart_from_decoding() {
        let decode = [("admission", 0.1), ("local_prefill", 0.3), ("decode", 0.5), ("admission", 0.7), ("decode", 0.8)];
        let b = breakdown(&ROUTER, &[] as &[(&str, f64)], &decode);
        let get = |p: &str| get(&b, p);
        assert_eq!((get("decode_admission"), get("local_prefill"), get("transfer")), (0.1, 0.3, 0.0));
        assert!((get("readmission") - 0.7).abs() < 1e-9 && (get("decode") - 1.3).abs() < 1e-9, "{b:?}");
        sums_to_the_routers_time(&b);
    }

    #[test]
    fn without_decodes_laps_prefills_phases_stand_for_its_wait_and_the_sum_holds() {
        // A stop string found by the router ends the stream before decode's last message:
        // decode's laps are missing (or only those up to its first token arrived).
        let prefill = [("prefill_queue", 0.2), ("prefill_compute", 0.5), ("transfer", 0.05)];
        let b = breakdown(&ROUTER, &prefill, &[] as &[(&str, f64)]);
        let get = |p: &str| get(&b, p);
        assert!((get("other") - 0.3).abs() < 1e-9 && get("transfer") == 0.0, "{b:?}");
        sums_to_the_routers_time(&b);
    }

    #[test]
    fn retracted_before_its_first_token_the_lost_work_is_readmission() {
        let decode =
            [("admission", 0.1), ("retracted", 0.2), ("admission", 0.3), ("local_prefill", 0.3), ("decode", 2.0)];
        let b = breakdown(&ROUTER, &[] as &[(&str, f64)], &decode);
        let get = |p: &str| get(&b, p);
        assert_eq!((get("decode_admission"), get("local_prefill")), (0.1, 0.3));
        assert!((get("readmission") - 0.5).abs() < 1e-9 && (get("other") - 0.1).abs() < 1e-9, "{b:?}");
        sums_to_the_routers_time(&b);
    }

    #[test]
    fn a_worker_reporting_more_than_the_router_saw_clamps_at_zero() {
        let decode = [("admission", 0.5), ("transfer", 2.0), ("first_token", 0.1)];
        let b = breakdown(&ROUTER, &[("prefill_queue", 3.0)], &decode);
        assert!(b.iter().all(|(_, s)| *s >= 0.0), "{b:?}");
    }
}
