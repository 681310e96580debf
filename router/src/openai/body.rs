//! The request body as clients send it: the fields both endpoints read, the ones refused by
//! name, the ones ignored and counted, and the parse that names a field of the wrong type.

use axum::http::StatusCode;
use axum::response::Response;
use serde::Deserialize;
use serde_json::json;

use super::err;
use super::messages::MessageIn;

#[derive(Debug, Deserialize)]
#[serde(untagged, expecting = "a string, a list of strings, a list of token ids or a list of such lists")]
pub(super) enum PromptIn {
    Text(String),
    Texts(Vec<String>),
    Ids(Vec<u32>),
    IdLists(Vec<Vec<u32>>),
}

#[derive(Debug, Deserialize)]
#[serde(untagged, expecting = "a string or a list of strings")]
pub(super) enum StopIn {
    One(String),
    Many(Vec<String>),
}

/// Fields both endpoints read. Fields Ferry does not know are ignored, logged at debug and
/// counted (`ferry_openai_ignored_fields_total{field}`), as vLLM and SGLang do: clients and
/// SDKs send many (`metadata`, `store`, `service_tier`, ...). Fields Ferry knows but does not
/// serve yet, and that would change the answer, are refused by name ([`UNSERVED`]).
#[derive(Debug, Deserialize)]
pub(super) struct Common {
    pub(super) model: String,
    #[serde(default)]
    pub(super) prompt: Option<PromptIn>,
    #[serde(default)]
    pub(super) messages: Option<Vec<MessageIn>>,
    #[serde(default)]
    pub(super) max_tokens: Option<u32>,
    #[serde(default)]
    pub(super) max_completion_tokens: Option<u32>,
    #[serde(default)]
    pub(super) temperature: Option<f32>,
    #[serde(default)]
    pub(super) top_p: Option<f32>,
    #[serde(default)]
    pub(super) top_k: Option<u32>,
    #[serde(default)]
    pub(super) min_p: Option<f32>,
    #[serde(default)]
    pub(super) presence_penalty: Option<f32>,
    #[serde(default)]
    pub(super) frequency_penalty: Option<f32>,
    #[serde(default)]
    pub(super) repetition_penalty: Option<f32>,
    #[serde(default)]
    pub(super) seed: Option<u64>,
    #[serde(default)]
    pub(super) stop: Option<StopIn>,
    #[serde(default)]
    pub(super) stream: bool,
    /// Accepted (OpenAI clients send `{"include_usage": true}`); usage always comes with the
    /// last streamed chunk.
    #[serde(default, rename = "stream_options")]
    pub(super) _stream_options: Option<serde_json::Value>,
    #[serde(default)]
    pub(super) n: Option<u32>,
    /// Accepted and ignored (OpenAI clients send it).
    #[serde(default, rename = "user")]
    pub(super) _user: Option<String>,
    #[serde(default)]
    pub(super) ignore_eos: bool,
    /// Chat: `true` returns the chosen tokens' logprobs. Completions: a number (0–20) returns
    /// them with that many alternatives per token.
    #[serde(default)]
    pub(super) logprobs: Option<serde_json::Value>,
    /// Chat: alternatives per token (0–20), with `logprobs: true`.
    #[serde(default)]
    pub(super) top_logprobs: Option<u32>,
    /// `{"type": "text" | "json_object" | "json_schema", "json_schema": {"schema", ...}}`.
    #[serde(default)]
    pub(super) response_format: Option<serde_json::Value>,
    /// vLLM's extensions: output as JSON of this schema, matching this regex, or one of these.
    #[serde(default)]
    pub(super) guided_json: Option<serde_json::Value>,
    #[serde(default)]
    pub(super) guided_regex: Option<String>,
    #[serde(default)]
    pub(super) guided_choice: Option<Vec<String>>,
    /// Chat: functions the model may call, and whether / which it must (`tools.rs`).
    #[serde(default)]
    pub(super) tools: Option<serde_json::Value>,
    #[serde(default)]
    pub(super) tool_choice: Option<serde_json::Value>,
    /// Completions: the prompt comes back before the completion (with its logprobs when
    /// `logprobs` is set; `max_tokens: 0` then scores the prompt alone).
    #[serde(default)]
    pub(super) echo: bool,
    /// Token id (as a string: JSON object keys) to a bias added to its logit, in [-100, 100].
    #[serde(default)]
    pub(super) logit_bias: Option<std::collections::HashMap<String, f32>>,
    /// Everything else.
    #[serde(flatten)]
    pub(super) other: serde_json::Map<String, serde_json::Value>,
}

/// Fields that ask for something Ferry does not do yet: refused, not ignored, since ignoring
/// them would silently change the answer. Values that ask for nothing (`false`, `null`, an
/// empty list, `"auto"` / `"none"` tool choice, `{"type": "text"}`) pass.
const UNSERVED: [&str; 2] = ["functions", "suffix"];

/// Well-known fields counted under their own name when ignored; any other is counted as
/// `other` (a label per field a client invents would make the metric unbounded).
const KNOWN_IGNORED: [&str; 12] = [
    "metadata",
    "store",
    "user",
    "service_tier",
    "parallel_tool_calls",
    "stream_options",
    "best_of",
    "reasoning_effort",
    "modalities",
    "prediction",
    "audio",
    "web_search_options",
];

/// Whether a field's value asks for nothing (`false`, `null`, empty, `"none"`/`"auto"`,
/// `{"type": "text"}`, 0).
pub(super) fn asks_for_nothing(v: &serde_json::Value) -> bool {
    use serde_json::Value;
    match v {
        Value::Null => true,
        Value::Bool(b) => !b,
        Value::Array(a) => a.is_empty(),
        Value::Object(o) => o.is_empty() || (o.len() == 1 && o.get("type") == Some(&json!("text"))),
        Value::String(s) => s == "none" || s == "auto",
        Value::Number(n) => n.as_u64() == Some(0),
    }
}

/// Refuses an unserved field that asks for something; counts and logs the ignored ones.
// The error is the finished HTTP response, returned once per request: its size is no concern.
#[allow(clippy::result_large_err)]
pub(super) fn other_fields(other: &serde_json::Map<String, serde_json::Value>) -> Result<(), Response> {
    for (k, v) in other {
        if UNSERVED.contains(&k.as_str()) {
            if asks_for_nothing(v) {
                continue;
            }
            return Err(err(
                StatusCode::BAD_REQUEST,
                "unsupported",
                format!("`{k}` is not supported by this server yet"),
            ));
        }
        let label = KNOWN_IGNORED.iter().copied().find(|x| *x == k).unwrap_or("other");
        tracing::debug!(field = %k.escape_debug(), "ignored request field");
        metrics::counter!(ferry_cluster::metrics::OPENAI_IGNORED_FIELDS, "field" => label).increment(1);
    }
    Ok(())
}

/// The body's fields, or why not, naming the field that is wrong ("max_tokens: invalid
/// value: integer `-3`, expected u32 at line 1 column 83"; serde alone names only the place).
pub(super) fn common(text: &str) -> Result<Common, super::FieldError> {
    let mut de = serde_json::Deserializer::from_str(text);
    let c: Common = serde_path_to_error::deserialize(&mut de).map_err(|e| match e.path().to_string() {
        at if at == "." => super::FieldError(e.into_inner().to_string()),
        at => super::FieldError(format!("{at}: {}", e.into_inner())),
    })?;
    de.end().map_err(|e| super::FieldError(e.to_string()))?;
    Ok(c)
}
