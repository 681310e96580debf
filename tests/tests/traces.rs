//! One request followed across daemons (issue 18): the router takes the caller's W3C
//! `traceparent` (HTTP header or gRPC metadata) or starts a trace, and the prefill and decode
//! workers' spans for the request carry the same trace id, the request id and the room.
//!
//! The spans are caught by a tracing layer installed for this test binary alone (the
//! subscriber is process-wide), so the three daemons run in this process.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use ferry_tests::{TinyModel, http_with, one_of_each};
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing_subscriber::layer::{Context, SubscriberExt as _};

type Seen = Arc<Mutex<Vec<HashMap<String, String>>>>;

/// Records the fields of every `request` span, those recorded after it was made included.
#[derive(Default)]
struct Spans {
    seen: Seen,
    /// Span id → its place in `seen`.
    at: Mutex<HashMap<u64, usize>>,
}

struct Fields<'a>(&'a mut HashMap<String, String>);

impl Visit for Fields<'_> {
    fn record_debug(&mut self, f: &Field, v: &dyn std::fmt::Debug) {
        self.0.insert(f.name().to_string(), format!("{v:?}").trim_matches('"').to_string());
    }
    fn record_str(&mut self, f: &Field, v: &str) {
        self.0.insert(f.name().to_string(), v.to_string());
    }
}

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Spans {
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, _ctx: Context<'_, S>) {
        if attrs.metadata().name() == "request" {
            let mut fields = HashMap::new();
            attrs.record(&mut Fields(&mut fields));
            let mut seen = self.seen.lock().expect("spans");
            self.at.lock().expect("ids").insert(id.into_u64(), seen.len());
            seen.push(fields);
        }
    }

    fn on_record(&self, id: &Id, values: &Record<'_>, _ctx: Context<'_, S>) {
        // One lock at a time: `on_new_span` takes `seen` then `at`, and holding `at` here
        // while taking `seen` deadlocked two daemons' threads (seen in a CI rehearsal: the
        // test hung with every thread waiting).
        let i = self.at.lock().expect("ids").get(&id.into_u64()).copied();
        if let Some(i) = i {
            values.record(&mut Fields(&mut self.seen.lock().expect("spans")[i]));
        }
    }
}

/// The `request` spans whose field `key` is `value`, by role.
fn spans_with(seen: &Seen, key: &str, value: &str) -> HashMap<String, HashMap<String, String>> {
    let all = seen.lock().expect("spans");
    all.iter()
        .filter(|s| s.get(key).map(String::as_str) == Some(value))
        .map(|s| (s.get("role").cloned().unwrap_or_default(), s.clone()))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_trace_id_follows_a_request_through_router_prefill_and_decode() {
    let seen: Seen = Arc::default();
    let subscriber = tracing_subscriber::registry().with(Spans { seen: Arc::clone(&seen), at: Default::default() });
    tracing::subscriber::set_global_default(subscriber).expect("the only subscriber of this binary");
    let m = TinyModel::new();
    let (p, d, r) = one_of_each(&m, 512, |_| {}).await;

    // gRPC, with the caller's trace and request id.
    let caller_trace = "4bf92f3577b34da6a3ce929d0e0e4736";
    let parent = format!("00-{caller_trace}-00f067aa0ba902b7-01");
    ferry_tests::generate_traced(r.grpc_addr, "chat-42", (1..40).collect(), 4, &parent).await;

    let by_role = spans_with(&seen, "trace_id", caller_trace);
    for role in ["router", "prefill", "decode"] {
        let span = by_role.get(role).unwrap_or_else(|| panic!("no {role} span in the caller's trace: {by_role:?}"));
        assert_eq!(span.get("request_id").map(String::as_str), Some("chat-42"), "{role}: {span:?}");
        assert_ne!(span.get("span_id").map(String::as_str), Some("00f067aa0ba902b7"), "{role}: a span of its own");
    }
    let room = |role: &str| by_role[role].get("room").cloned();
    assert!(room("router").is_some_and(|r| r.starts_with("room-")), "{by_role:?}");
    assert_eq!((room("prefill"), room("decode")), (room("router"), room("router")), "one room on every daemon");

    // HTTP without a traceparent: the router starts a trace, and the workers join it.
    let body = br#"{"model":"hf","prompt":[5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20,21],"max_tokens":3}"#;
    let before = seen.lock().expect("spans").len();
    let (status, _, text) = http_with(r.http_addr, "POST", "/v1/completions", &[], body).await;
    assert_eq!(status, 200, "{text}");
    let fresh: Vec<HashMap<String, String>> = seen.lock().expect("spans")[before..].to_vec();
    let router = fresh.iter().find(|s| s.get("role").map(String::as_str) == Some("router")).expect("a router span");
    let trace = router.get("trace_id").expect("trace id").clone();
    assert_eq!(trace.len(), 32, "{router:?}");
    let roles: Vec<&str> = fresh
        .iter()
        .filter(|s| s.get("trace_id") == Some(&trace))
        .filter_map(|s| s.get("role").map(String::as_str))
        .collect();
    for role in ["router", "prefill", "decode"] {
        assert!(roles.contains(&role), "{role} missing from the router's trace: {fresh:?}");
    }

    // A malformed traceparent starts a new trace instead of failing the request.
    let bad = [("traceparent", "00-not-a-trace-01")];
    let (status, _, text) = http_with(r.http_addr, "POST", "/v1/completions", &bad, body).await;
    assert_eq!(status, 200, "{text}");
    r.stop().await;
    d.stop().await;
    p.stop().await;
}
