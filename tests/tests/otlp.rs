//! `--otlp-endpoint` (issue 18): each request's spans on the router, prefill and decode reach
//! an OTLP/gRPC collector as one trace — the caller's trace id, the router's span a child of
//! the caller's, the workers' spans children of the router's.
//!
//! The collector is a real OTLP trace service ([`ferry_tests::otlp::Collector`]) on a
//! loopback port; the export is process-wide, so this binary holds this test alone.

use std::collections::HashMap;
use std::time::Duration;

use ferry_tests::otlp::{Collector, Got};
use ferry_tests::{TinyModel, one_of_each};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_requests_spans_reach_an_otlp_collector_as_one_trace() {
    let (collector, addr) = Collector::serve("127.0.0.1:0", true).await;
    let telemetry =
        ferry_cluster::telemetry::init("ferry-test", "warn", Some(&format!("http://{addr}"))).expect("exporter");

    let m = TinyModel::new();
    let (p, d, r) = one_of_each(&m, 512, |_| {}).await;
    let caller = ("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7");
    let parent = format!("00-{}-{}-01", caller.0, caller.1);
    ferry_tests::generate_traced(r.grpc_addr, "eval-7", (1..40).collect(), 4, &parent).await;
    // The workers' spans end when their engines forget the request: stopping ends them all.
    r.stop().await;
    d.stop().await;
    p.stop().await;

    let mut spans: HashMap<String, Got> = HashMap::new();
    for _ in 0..100 {
        telemetry.flush();
        let got = collector.spans();
        spans = got
            .into_iter()
            .filter(|s| s.trace == caller.0)
            .filter_map(|s| Some((s.attrs.get("role")?.clone(), s)))
            .collect();
        if spans.len() == 3 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let router = spans.get("router").unwrap_or_else(|| panic!("no router span in the caller's trace: {spans:?}"));
    assert_eq!(router.parent, caller.1, "the router's span is a child of the caller's: {router:?}");
    for role in ["prefill", "decode"] {
        let w = spans.get(role).unwrap_or_else(|| panic!("no {role} span in the caller's trace: {spans:?}"));
        assert_eq!(w.parent, router.id, "{role}'s span is a child of the router's: {spans:?}");
        assert_eq!(w.attrs.get("request_id").map(String::as_str), Some("eval-7"), "{w:?}");
        assert_eq!(w.attrs.get("room"), router.attrs.get("room"), "one room: {spans:?}");
        assert_eq!(w.attrs.get("span_id"), Some(&w.id), "the logged span id is the exported one: {w:?}");
    }
}
