//! W3C trace context (`traceparent`, <https://www.w3.org/TR/trace-context/>): how one request
//! is followed across the router, the prefill node and the decode node. The router takes a
//! caller's `traceparent` (HTTP header or gRPC metadata) or starts a trace, and passes it on
//! in the gRPC metadata of every call to a worker; each daemon's span for the request carries
//! the trace id, so one id finds the request in every daemon's logs (and in an OTLP backend).

use std::fmt;

use rand::Rng;

/// The metadata key (HTTP header and gRPC metadata) that carries the context.
pub const TRACEPARENT: &str = "traceparent";

/// One span's place in a trace: the trace it belongs to and its own span id.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TraceContext {
    /// The whole trace's id (16 bytes, never all zero).
    pub trace_id: [u8; 16],
    /// The span's id (8 bytes, never all zero): the parent of the spans it calls.
    pub span_id: [u8; 8],
    /// Whether the trace is sampled (the caller's `sampled` flag; our own traces are).
    pub sampled: bool,
}

fn hex_to<const N: usize>(s: &str) -> Option<[u8; N]> {
    if s.len() != 2 * N || !s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)) {
        return None; // lowercase hex only, as the specification requires
    }
    let mut out = [0u8; N];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).ok()?;
    }
    (out != [0u8; N]).then_some(out)
}

fn hex(b: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(2 * b.len());
    for &x in b {
        s.push(char::from(DIGITS[usize::from(x >> 4)]));
        s.push(char::from(DIGITS[usize::from(x & 15)]));
    }
    s
}

impl TraceContext {
    /// A new trace (a random trace id and span id), sampled.
    pub fn random() -> Self {
        let mut rng = rand::rng();
        let mut trace_id = [0u8; 16];
        let mut span_id = [0u8; 8];
        while trace_id == [0; 16] {
            rng.fill(&mut trace_id);
        }
        while span_id == [0; 8] {
            rng.fill(&mut span_id);
        }
        Self { trace_id, span_id, sampled: true }
    }

    /// Parses a `traceparent` value (`00-<32 hex>-<16 hex>-<2 hex flags>`). A later version
    /// is read for its first four fields, as the specification asks; anything malformed
    /// (all-zero ids, uppercase, version `ff`) is None: the caller then starts a new trace.
    pub fn parse(v: &str) -> Option<Self> {
        let mut it = v.trim().split('-');
        let version = it.next()?;
        let (trace, span, flags) = (it.next()?, it.next()?, it.next()?);
        let rest = it.next();
        let byte = |s: &str| {
            let lower = s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
            if s.len() == 2 && lower { u8::from_str_radix(s, 16).ok() } else { None }
        };
        let ver = byte(version)?;
        if ver == 0xff || (ver == 0 && rest.is_some()) {
            return None;
        }
        let flags = byte(flags)?;
        Some(Self { trace_id: hex_to(trace)?, span_id: hex_to(span)?, sampled: flags & 1 == 1 })
    }

    /// A span under this one: the same trace, a new span id.
    pub fn child(&self) -> Self {
        Self { span_id: Self::random().span_id, ..*self }
    }

    /// The trace id in lowercase hex (32 characters), as logs and OTLP backends show it.
    pub fn trace_id_hex(&self) -> String {
        hex(&self.trace_id)
    }

    /// The span id in lowercase hex (16 characters).
    pub fn span_id_hex(&self) -> String {
        hex(&self.span_id)
    }
}

/// The `traceparent` value naming this span as the parent.
impl fmt::Display for TraceContext {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "00-{}-{}-{:02x}", self.trace_id_hex(), self.span_id_hex(), u8::from(self.sampled))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn traceparent_round_trips_and_children_keep_the_trace() {
        let v = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let t = TraceContext::parse(v).expect("the specification's example");
        assert_eq!(t.trace_id_hex(), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!((t.span_id_hex().as_str(), t.sampled), ("00f067aa0ba902b7", true));
        assert_eq!(t.to_string(), v);
        let c = t.child();
        assert_eq!(c.trace_id, t.trace_id);
        assert_ne!(c.span_id, t.span_id);
        let r = TraceContext::random();
        assert_eq!(TraceContext::parse(&r.to_string()), Some(r));
        // A later version with more fields is read for the fields we know.
        assert!(TraceContext::parse("01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00-extra").is_some());
    }

    #[test]
    fn malformed_traceparents_are_refused() {
        for bad in [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-1",
            "0-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        ] {
            assert_eq!(TraceContext::parse(bad), None, "{bad:?}");
        }
    }
}
