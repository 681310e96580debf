//! Bounds on what a caller sends besides the prompt, checked before any work is done for the
//! request, on both APIs: stop strings (scanned at every token, so their number and length
//! bound per-token work) and the gRPC `request_id` (echoed in every message and written in
//! log lines, so it must be short and printable: a newline in it would forge a log line).

use ferry_cluster::RequestId;

/// Most characters of a caller's `request_id`.
pub const MAX_REQUEST_ID_CHARS: usize = 128;
/// Most bytes of a caller's `request_id` (what a `RequestId` holds: longer ones would come
/// back cut).
pub const MAX_REQUEST_ID_BYTES: usize = 256;

/// Default of `--max-stop-strings`.
pub const DEFAULT_MAX_STOP_STRINGS: usize = 16;
/// Default of `--max-stop-string-bytes`.
pub const DEFAULT_MAX_STOP_BYTES: usize = 256;

/// The configurable bounds (`--max-stop-strings`, `--max-stop-string-bytes`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Most stop strings per request.
    pub max_stop_strings: usize,
    /// Most bytes of one stop string.
    pub max_stop_bytes: usize,
}

/// A refused field: a stable reason (a metrics label) and a message naming the field.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    /// Stable reason.
    pub reason: &'static str,
    /// What is wrong, naming the field.
    pub message: String,
}

impl Default for Limits {
    fn default() -> Self {
        Self { max_stop_strings: DEFAULT_MAX_STOP_STRINGS, max_stop_bytes: DEFAULT_MAX_STOP_BYTES }
    }
}

fn refuse<T>(reason: &'static str, message: String) -> Result<T, Refusal> {
    Err(Refusal { reason, message })
}

impl Limits {
    /// Checks the stop strings of one request.
    pub fn check_stop(&self, stop: &[String]) -> Result<(), Refusal> {
        if stop.len() > self.max_stop_strings {
            let why = format!("`stop` has {} strings; at most {} are accepted", stop.len(), self.max_stop_strings);
            return refuse("too_many_stop_strings", why);
        }
        if stop.iter().any(String::is_empty) {
            return refuse("bad_stop", "`stop` strings must not be empty".into());
        }
        if let Some((i, s)) = stop.iter().enumerate().find(|(_, s)| s.len() > self.max_stop_bytes) {
            let why = format!("`stop[{i}]` has {} bytes; at most {} are accepted", s.len(), self.max_stop_bytes);
            return refuse("stop_string_too_long", why);
        }
        Ok(())
    }
}

/// A caller's `request_id`, checked: at most [`MAX_REQUEST_ID_CHARS`] characters and
/// [`MAX_REQUEST_ID_BYTES`] bytes, none of them a control character; empty: a new random id.
pub fn check_request_id(id: String) -> Result<RequestId, Refusal> {
    let n = id.chars().count();
    if n > MAX_REQUEST_ID_CHARS {
        return refuse("bad_request_id", format!("`request_id` has {n} characters; at most {MAX_REQUEST_ID_CHARS}"));
    }
    if id.len() > MAX_REQUEST_ID_BYTES {
        let n = id.len();
        return refuse("bad_request_id", format!("`request_id` has {n} bytes; at most {MAX_REQUEST_ID_BYTES}"));
    }
    if let Some(c) = id.chars().find(|c| c.is_control()) {
        return refuse("bad_request_id", format!("`request_id` holds the control character {c:?}"));
    }
    Ok(if id.is_empty() { RequestId::random() } else { RequestId::new(id) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stop_lists_and_request_ids_are_bounded() {
        let l = Limits { max_stop_strings: 2, max_stop_bytes: 4 };
        let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
        assert!(l.check_stop(&s(&["ab", "abcd"])).is_ok());
        assert_eq!(l.check_stop(&s(&["a", "b", "c"])).map_err(|r| r.reason), Err("too_many_stop_strings"));
        assert_eq!(l.check_stop(&s(&["a", ""])).map_err(|r| r.reason), Err("bad_stop"));
        let e = l.check_stop(&s(&["a", "abcde"])).expect_err("too long");
        assert_eq!((e.reason, e.message.contains("stop[1]")), ("stop_string_too_long", true));
        assert_eq!(check_request_id("chat-42_x.y".into()).map(|r| r.to_string()), Ok("chat-42_x.y".into()));
        let long = "é".repeat(MAX_REQUEST_ID_CHARS);
        assert_eq!(check_request_id(long.clone()).map(|r| r.to_string()), Ok(long), "characters, not bytes");
        assert!(check_request_id("x".repeat(MAX_REQUEST_ID_CHARS + 1)).is_err());
        let wide = check_request_id("€".repeat(MAX_REQUEST_ID_CHARS)).expect_err("384 bytes: would be cut");
        assert!(wide.message.contains("bytes"), "{}", wide.message);
        assert!(check_request_id(String::new()).is_ok_and(|r| r.as_str().starts_with("req-")), "made when empty");
        let e = check_request_id("a\nWARN forged line".into()).expect_err("newline");
        assert!(e.message.contains("request_id"), "{}", e.message);
    }
}
