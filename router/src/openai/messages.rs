//! Chat messages as requests send them, and the prompt text they render to: through the
//! model's chat template, with the tools shown to the model when a request offers some
//! (by the template itself when it reads `tools`, else as [`tools::rewrite`] writes them).

use super::FieldError;
use ferry_tokenize::{ChatMessage, ChatTemplate};
use serde::Deserialize;
use serde_json::Value;

use super::tools::{self, Tools};

/// A chat message: `content` is a string, a list of parts (text parts are joined with
/// newlines, as vLLM does; other kinds are refused by name) or null (an assistant turn that
/// called tools).
#[derive(Debug, Deserialize)]
pub(super) struct MessageIn {
    #[serde(default)]
    role: Option<String>,
    #[serde(default)]
    content: Option<ContentIn>,
    /// An assistant's earlier calls.
    #[serde(default)]
    tool_calls: Option<Value>,
    /// The call a `tool` message answers.
    #[serde(default)]
    tool_call_id: Option<String>,
    #[serde(default)]
    name: Option<String>,
    /// Anything else is ignored.
    #[serde(flatten)]
    _other: serde_json::Map<String, Value>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum ContentIn {
    Text(String),
    Parts(Vec<PartIn>),
}

#[derive(Debug, Deserialize)]
struct PartIn {
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    text: Option<String>,
}

/// The messages as the chat template takes them: each with a role, text content.
fn chat_messages(ms: &[MessageIn]) -> Result<Vec<ChatMessage>, FieldError> {
    if ms.is_empty() {
        return Err("`messages` is empty: at least one message is required".into());
    }
    let mut out = Vec::with_capacity(ms.len());
    for (i, m) in ms.iter().enumerate() {
        let Some(role) = m.role.as_deref().filter(|r| !r.is_empty()) else {
            return Err(format!("`messages[{i}].role` is missing").into());
        };
        let text = match &m.content {
            None => String::new(),
            Some(ContentIn::Text(t)) => t.clone(),
            Some(ContentIn::Parts(parts)) => {
                let mut texts = Vec::with_capacity(parts.len());
                for (j, p) in parts.iter().enumerate() {
                    match (p.kind.as_str(), &p.text) {
                        ("text", Some(t)) => texts.push(t.as_str()),
                        ("text", None) => {
                            return Err(format!("`messages[{i}].content[{j}]` is a text part without `text`").into());
                        }
                        (k, _) => {
                            return Err(format!(
                                "`messages[{i}].content[{j}]` is a {k:?} part; this model reads text parts only"
                            )
                            .into());
                        }
                    }
                }
                texts.join("\n")
            }
        };
        out.push(ChatMessage::new(role.to_string(), text));
    }
    Ok(out)
}

/// The prompt text of `ms` with the generation prompt, `tools` shown to the model.
pub(super) fn render(t: &ChatTemplate, ms: &[MessageIn], tools: Option<&Tools>) -> Result<String, FieldError> {
    let texts = chat_messages(ms)?;
    let calls = ms.iter().any(|m| m.tool_calls.is_some()) || texts.iter().any(|m| m.role == "tool");
    if tools.is_none() && !calls {
        return t.render(&texts, true).map_err(|e| FieldError::from(e.to_string()));
    }
    if t.supports_tools() {
        let msgs: Vec<Value> = ms
            .iter()
            .zip(&texts)
            .map(|(m, c)| {
                let mut o = serde_json::json!({"role": c.role, "content": c.content});
                if let Some(calls) = &m.tool_calls {
                    o["tool_calls"] = parsed_arguments(calls);
                }
                if let Some(id) = &m.tool_call_id {
                    o["tool_call_id"] = id.clone().into();
                }
                if let Some(n) = &m.name {
                    o["name"] = n.clone().into();
                }
                o
            })
            .collect();
        let raw: Option<Vec<Value>> = tools.map(|t| t.functions.iter().map(|f| f.raw.clone()).collect());
        return t.render_json(&msgs, raw.as_deref(), true).map_err(|e| FieldError::from(e.to_string()));
    }
    let plain = ms.iter().zip(texts).map(|(m, c)| (c.role, c.content, m.tool_calls.clone())).collect();
    let rewritten: Vec<ChatMessage> =
        tools::rewrite(tools, plain).into_iter().map(|(role, content)| ChatMessage::new(role, content)).collect();
    t.render(&rewritten, true).map_err(|e| FieldError::from(e.to_string()))
}

/// Earlier calls with their `arguments` as JSON objects (OpenAI sends a string; templates
/// read an object).
fn parsed_arguments(calls: &Value) -> Value {
    let mut calls = calls.clone();
    for c in calls.as_array_mut().into_iter().flatten() {
        if let Some(a) = c.get_mut("function").and_then(|f| f.get_mut("arguments"))
            && let Some(s) = a.as_str()
            && let Ok(v) = serde_json::from_str::<Value>(s)
        {
            *a = v;
        }
    }
    calls
}
