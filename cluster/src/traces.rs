//! The trace context on gRPC calls between daemons (W3C `traceparent` in the metadata, see
//! `ferry_core::trace`), and the span each daemon opens for each request it serves.

use ferry_core::trace::{TRACEPARENT, TraceContext};
use ferry_core::{RequestId, Room};

/// The caller's trace context, when its metadata carries a well-formed one.
pub fn from_metadata(m: &tonic::metadata::MetadataMap) -> Option<TraceContext> {
    TraceContext::parse(m.get(TRACEPARENT)?.to_str().ok()?)
}

/// `msg` as a call whose metadata names `parent` as the caller's span.
pub fn request_with<T>(msg: T, parent: &TraceContext) -> tonic::Request<T> {
    let mut r = tonic::Request::new(msg);
    if let Ok(v) = parent.to_string().parse() {
        r.metadata_mut().insert(TRACEPARENT, v);
    }
    r
}

/// The span a daemon serves one request in: its role, the caller's request id (at most 256
/// bytes, written escaped: a direct caller cannot forge log lines), the room and the trace id
/// (the caller's, or a new trace when it sent none). Every log line about the request, on the
/// handler and on the engine thread, is written inside it. Returns the span and its context
/// (the parent of the calls the daemon makes for the request).
pub fn request_span(
    role: &'static str,
    id: &RequestId,
    room: Room,
    caller: Option<TraceContext>,
) -> (tracing::Span, TraceContext) {
    let span = tracing::info_span!(
        "request",
        role,
        request_id = ?id.as_str(),
        room = %room,
        trace_id = tracing::field::Empty,
        span_id = tracing::field::Empty,
    );
    let trace = crate::telemetry::join(&span, caller);
    (span, trace)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_context_crosses_grpc_metadata() {
        let t = TraceContext::random();
        let r = request_with((), &t);
        assert_eq!(from_metadata(r.metadata()), Some(t));
        let mut bad = tonic::metadata::MetadataMap::new();
        bad.insert(TRACEPARENT, "00-zz".parse().expect("ascii"));
        assert_eq!(from_metadata(&bad), None);
        assert_eq!(from_metadata(&tonic::metadata::MetadataMap::new()), None);
    }
}
