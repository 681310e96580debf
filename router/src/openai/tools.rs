//! Tool calls (`tools`, `tool_choice`) on chat completions.
//!
//! - `tool_choice: "none"` (or no tools): plain chat; the tools are not shown to the model.
//! - a named function (`{"type": "function", "function": {"name": ...}}`): the output is
//!   constrained to that function's `parameters` schema and becomes one call's arguments.
//! - `"required"`: the output is constrained to a JSON array of one or more
//!   `{"name": <a tool>, "parameters": <its arguments>}` (vLLM's shape), each a call.
//! - `"auto"` (the default with tools): the model answers freely and may call tools in the
//!   Hermes format, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, which is
//!   parsed out of its text.
//!
//! The model learns of the tools from its chat template when the template reads `tools`;
//! otherwise (SmolLM2's, for one) from a Hermes-style system message Ferry writes, and
//! earlier calls and their results are written in the same format.

use super::FieldError;
use ferry_tokenize::Constraint;
use serde_json::{Value, json};

/// The tag that opens a call in the Hermes format.
pub const OPEN: &str = "<tool_call>";
const CLOSE: &str = "</tool_call>";

/// One function a request offers.
#[derive(Debug, Clone, PartialEq)]
pub struct Function {
    /// Its name.
    pub name: String,
    /// The JSON Schema of its arguments (`{"type": "object"}` when none is given).
    pub parameters: Value,
    /// The tool as the request gave it (what the model is shown).
    pub raw: Value,
}

/// How the model may call tools.
#[derive(Debug, Clone, PartialEq)]
pub enum Mode {
    /// It must call this function, once.
    Named(String),
    /// It must call one or more of the tools.
    Required,
    /// It may answer or call tools (Hermes format).
    Auto,
}

/// A request's tools and how they may be called (`None` from [`parse`]: no tool use).
#[derive(Debug, Clone, PartialEq)]
pub struct Tools {
    /// The functions.
    pub functions: Vec<Function>,
    /// How they may be called.
    pub mode: Mode,
}

/// One call the model made.
#[derive(Debug, Clone, PartialEq)]
pub struct Call {
    /// The function.
    pub name: String,
    /// Its arguments, as JSON text.
    pub arguments: String,
}

/// Reads `tools` and `tool_choice`; errors name the field.
pub fn parse(tools: Option<&Value>, choice: Option<&Value>) -> Result<Option<Tools>, FieldError> {
    let list = match tools {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(a)) => a.clone(),
        Some(_) => return Err("`tools` must be a list".into()),
    };
    let mut functions = Vec::with_capacity(list.len());
    for (i, t) in list.into_iter().enumerate() {
        if t.get("type").and_then(Value::as_str).is_some_and(|k| k != "function") {
            return Err(format!("`tools[{i}].type` must be \"function\"").into());
        }
        let Some(f) = t.get("function").filter(|f| f.is_object()) else {
            return Err(format!("`tools[{i}].function` is missing").into());
        };
        let name = f.get("name").and_then(Value::as_str).unwrap_or_default();
        if name.is_empty() {
            return Err(format!("`tools[{i}].function.name` is missing").into());
        }
        if functions.iter().any(|g: &Function| g.name == name) {
            return Err(format!("`tools[{i}].function.name` {name:?} is offered twice").into());
        }
        let parameters = match f.get("parameters") {
            None | Some(Value::Null) => json!({"type": "object"}),
            Some(p @ Value::Object(_)) => p.clone(),
            Some(_) => return Err(format!("`tools[{i}].function.parameters` must be a JSON Schema object").into()),
        };
        functions.push(Function { name: name.to_string(), parameters, raw: t });
    }
    let mode = match choice {
        None | Some(Value::Null) => Mode::Auto,
        Some(Value::String(s)) => match s.as_str() {
            "none" => return Ok(None),
            "auto" => Mode::Auto,
            "required" => Mode::Required,
            other => {
                return Err(
                    format!("`tool_choice` {other:?} is not \"none\", \"auto\", \"required\" or a function").into()
                );
            }
        },
        Some(v @ Value::Object(_)) => {
            let name = v.get("function").and_then(|f| f.get("name")).and_then(Value::as_str).unwrap_or_default();
            if name.is_empty() {
                return Err("`tool_choice.function.name` is missing".into());
            }
            if !functions.iter().any(|f| f.name == name) {
                return Err(format!("`tool_choice.function.name` {name:?} is not one of `tools`").into());
            }
            Mode::Named(name.to_string())
        }
        Some(_) => return Err("`tool_choice` must be a string or an object".into()),
    };
    if functions.is_empty() {
        return match mode {
            Mode::Auto => Ok(None),
            _ => Err("`tool_choice` asks for a tool call but `tools` is empty".into()),
        };
    }
    Ok(Some(Tools { functions, mode }))
}

impl Tools {
    /// The output constraint the mode needs: the named function's arguments, or the array of
    /// calls (`None` for `auto`).
    pub fn constraint(&self) -> Option<Constraint> {
        match &self.mode {
            Mode::Auto => None,
            Mode::Named(name) => {
                let f = self.functions.iter().find(|f| &f.name == name)?;
                Some(Constraint::JsonSchema(f.parameters.to_string()))
            }
            Mode::Required => {
                // Each function's schema moves under the root's `$defs` (its own `$defs` and
                // `definitions` beside it, renamed), so that its `$ref`s still resolve.
                let mut defs = serde_json::Map::new();
                let calls: Vec<Value> = self
                    .functions
                    .iter()
                    .enumerate()
                    .map(|(i, f)| {
                        let own = hoist(i, &f.parameters, &mut defs);
                        defs.insert(format!("tool{i}"), own);
                        json!({"type": "object",
                            "properties": {"name": {"const": f.name}, "parameters": {"$ref": format!("#/$defs/tool{i}")}},
                            "required": ["name", "parameters"], "additionalProperties": false})
                    })
                    .collect();
                let schema = json!({"type": "array", "minItems": 1, "items": {"anyOf": calls}, "$defs": defs});
                Some(Constraint::JsonSchema(schema.to_string()))
            }
        }
    }

    /// The system message that shows the tools to a model whose template does not read
    /// `tools` (the Hermes format, as Qwen2.5's and Hermes' templates write it).
    pub fn system_prompt(&self) -> String {
        let mut s = String::from(
            "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n\
             You are provided with function signatures within <tools></tools> XML tags:\n<tools>",
        );
        for f in &self.functions {
            s.push('\n');
            s.push_str(&f.raw.to_string());
        }
        s.push_str(
            "\n</tools>\n\nFor each function call, return a json object with function name and arguments within \
             <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>",
        );
        s
    }

    /// The calls in the model's output `text`, and what text is left as the answer's content.
    /// A forced call cut short (`stopped` false: `max_tokens` ran out) is no call: its text
    /// is the content.
    pub fn extract(&self, text: &str, stopped: bool) -> (Option<String>, Vec<Call>) {
        if !stopped && self.mode != Mode::Auto {
            return (Some(text.to_string()), Vec::new());
        }
        match &self.mode {
            Mode::Named(name) => (None, vec![Call { name: name.clone(), arguments: text.to_string() }]),
            Mode::Required => {
                let calls = serde_json::from_str::<Vec<Value>>(text)
                    .map(|v| v.iter().filter_map(|c| call(c, "parameters")).collect())
                    .unwrap_or_default();
                (None, calls)
            }
            Mode::Auto => hermes(text),
        }
    }
}

/// Function `i`'s `parameters` with its `$defs` / `definitions` moved into `defs` as
/// `tool{i}.{name}` and every `$ref` rewritten to match (`#` itself, the function's root,
/// becomes `#/$defs/tool{i}`).
fn hoist(i: usize, parameters: &Value, defs: &mut serde_json::Map<String, Value>) -> Value {
    fn rewrite(i: usize, v: &mut Value) {
        match v {
            Value::Object(o) => {
                for (k, x) in o.iter_mut() {
                    if k == "$ref"
                        && let Value::String(r) = x
                    {
                        let rest = r.strip_prefix("#/$defs/").or_else(|| r.strip_prefix("#/definitions/"));
                        *r = match (r.as_str(), rest) {
                            ("#", _) => format!("#/$defs/tool{i}"),
                            (_, Some(rest)) => format!("#/$defs/tool{i}.{rest}"),
                            _ => r.clone(),
                        };
                    } else {
                        rewrite(i, x);
                    }
                }
            }
            Value::Array(a) => a.iter_mut().for_each(|x| rewrite(i, x)),
            _ => {}
        }
    }
    let mut own = parameters.clone();
    rewrite(i, &mut own);
    if let Value::Object(o) = &mut own {
        for key in ["$defs", "definitions"] {
            if let Some(Value::Object(d)) = o.remove(key) {
                for (name, def) in d {
                    defs.insert(format!("tool{i}.{name}"), def);
                }
            }
        }
    }
    own
}

/// Calls in OpenAI's shape: `[{"id", "type": "function", "function": {"name", "arguments"}}]`,
/// with `index` when streamed.
pub fn to_json(calls: &[Call], streamed: bool) -> Value {
    calls
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let mut o = json!({"id": format!("call_{:016x}", rand::random::<u64>()), "type": "function",
                "function": {"name": c.name, "arguments": c.arguments}});
            if streamed {
                o["index"] = i.into();
            }
            o
        })
        .collect()
}

/// A streamed answer's text as it may go out while tool calls are looked for: `auto` streams
/// the text before a call's opening tag (holding back what may be the start of one) and
/// keeps the rest for the end; a forced call streams no text.
pub struct Holdback {
    tools: Tools,
    text: String,
    sent: usize,
    calling: bool,
}

impl Holdback {
    /// Nothing seen yet.
    pub fn new(tools: Tools) -> Self {
        Self { tools, text: String::new(), sent: 0, calling: false }
    }

    /// Takes the next piece of text; returns what may be streamed as content now.
    pub fn push(&mut self, piece: &str) -> String {
        self.text.push_str(piece);
        if self.tools.mode != Mode::Auto || self.calling {
            return String::new();
        }
        let unsent = &self.text[self.sent..];
        let upto = match unsent.find(OPEN) {
            Some(at) => {
                self.calling = true;
                at
            }
            // Hold back a tail that may be the start of the tag (ASCII: a char boundary).
            None => unsent.len() - (1..OPEN.len()).rev().find(|&k| unsent.ends_with(&OPEN[..k])).unwrap_or(0),
        };
        let out = unsent[..upto].to_string();
        self.sent += upto;
        out
    }

    /// At the end (`stopped`: the answer ended by itself): the content not streamed yet and
    /// the calls.
    pub fn finish(&mut self, stopped: bool) -> (Option<String>, Vec<Call>) {
        match self.tools.mode {
            Mode::Auto => {
                let (content, calls) = hermes(&self.text[self.sent..]);
                (content.filter(|c| !c.is_empty()), calls)
            }
            _ => self.tools.extract(&self.text, stopped),
        }
    }
}

/// `{"name": ..., <args>: {...}}` as a call.
fn call(v: &Value, args: &str) -> Option<Call> {
    let name = v.get("name")?.as_str()?.to_string();
    let arguments = v.get(args).or_else(|| v.get("parameters")).cloned().unwrap_or_else(|| json!({}));
    let arguments = match arguments {
        Value::String(s) => s,
        other => other.to_string(),
    };
    Some(Call { name, arguments })
}

/// The Hermes-format calls in `text` and the text outside them (`None` when only whitespace
/// is left). A call that does not parse stays in the text.
pub fn hermes(text: &str) -> (Option<String>, Vec<Call>) {
    let mut calls = Vec::new();
    let mut content = String::new();
    let mut rest = text;
    while let Some(at) = rest.find(OPEN) {
        let body = &rest[at + OPEN.len()..];
        let (inner, after) = match body.find(CLOSE) {
            Some(end) => (&body[..end], &body[end + CLOSE.len()..]),
            None => (body, ""),
        };
        match serde_json::from_str::<Value>(inner.trim()).ok().as_ref().and_then(|v| call(v, "arguments")) {
            Some(c) => {
                content.push_str(&rest[..at]);
                calls.push(c);
            }
            None => content.push_str(&rest[..rest.len() - after.len()]),
        }
        rest = after;
    }
    content.push_str(rest);
    let content = if content.trim().is_empty() && !calls.is_empty() { None } else { Some(content) };
    (content, calls)
}

/// The messages as a template without tool support reads them: the tools' system message
/// first (merged into the request's own), an assistant's earlier calls as Hermes
/// `<tool_call>` blocks, and a tool's result as a user message in `<tool_response>` tags.
pub fn rewrite(tools: Option<&Tools>, messages: Vec<(String, String, Option<Value>)>) -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = Vec::with_capacity(messages.len() + 1);
    for (role, content, calls) in messages {
        match role.as_str() {
            "assistant" if calls.is_some() => {
                let mut text = content;
                for c in calls.iter().flat_map(|c| c.as_array().cloned().unwrap_or_default()) {
                    let f = c.get("function").cloned().unwrap_or(Value::Null);
                    let args = match f.get("arguments") {
                        Some(Value::String(s)) => serde_json::from_str(s).unwrap_or(Value::String(s.clone())),
                        Some(v) => v.clone(),
                        None => json!({}),
                    };
                    let call = json!({"name": f.get("name").cloned().unwrap_or(Value::Null), "arguments": args});
                    if !text.is_empty() {
                        text.push('\n');
                    }
                    text.push_str(&format!("{OPEN}\n{call}\n{CLOSE}"));
                }
                out.push((role, text));
            }
            "tool" => out.push(("user".into(), format!("<tool_response>\n{content}\n</tool_response>"))),
            _ => out.push((role, content)),
        }
    }
    if let Some(t) = tools {
        let prompt = t.system_prompt();
        match out.first_mut() {
            Some((role, content)) if role == "system" => *content = format!("{content}\n\n{prompt}"),
            _ => out.insert(0, ("system".into(), prompt)),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn weather() -> Value {
        json!([{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}])
    }

    #[test]
    fn choices_parse_and_bad_ones_name_the_field() {
        let t = parse(Some(&weather()), None).expect("ok").expect("tools");
        assert_eq!(t.mode, Mode::Auto);
        assert_eq!(parse(Some(&weather()), Some(&json!("none"))), Ok(None));
        let named = json!({"type": "function", "function": {"name": "get_weather"}});
        assert_eq!(
            parse(Some(&weather()), Some(&named)).expect("ok").expect("tools").mode,
            Mode::Named("get_weather".into())
        );
        let cases = [
            (
                json!([{"type": "function", "function": {"description": "no name"}}]),
                json!("auto"),
                "tools[0].function.name",
            ),
            (weather(), json!({"type": "function", "function": {"name": "nope"}}), "tool_choice.function.name"),
            (weather(), json!("sometimes"), "tool_choice"),
            (json!([]), json!("required"), "`tools` is empty"),
            (json!([{"type": "function", "function": {"name": "f", "parameters": 3}}]), json!("auto"), "parameters"),
        ];
        for (tools, choice, field) in cases {
            let e = parse(Some(&tools), Some(&choice)).expect_err("refused");
            assert!(e.0.contains(field), "{field}: {e}");
        }
    }

    #[test]
    fn hermes_calls_are_parsed_out_of_the_text() {
        let text = "Let me look.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";
        let (content, calls) = hermes(text);
        assert_eq!(content.as_deref(), Some("Let me look.\n"));
        assert_eq!(calls, vec![Call { name: "get_weather".into(), arguments: "{\"city\":\"Paris\"}".into() }]);
        let (content, calls) = hermes("<tool_call>{\"name\": \"a\", \"arguments\": {}}</tool_call>");
        assert_eq!((content, calls.len()), (None, 1));
        let broken = "<tool_call>{not json</tool_call> and more";
        assert_eq!(hermes(broken), (Some(broken.to_string()), vec![]));
        assert_eq!(hermes("no calls"), (Some("no calls".into()), vec![]));
    }

    #[test]
    fn required_calls_come_from_the_constrained_array() {
        let t = Tools { mode: Mode::Required, ..parse(Some(&weather()), None).expect("ok").expect("tools") };
        let c = t.constraint().expect("a schema");
        assert!(matches!(&c, Constraint::JsonSchema(s) if s.contains("\"minItems\":1")), "{c:?}");
        let out = r#"[{"name": "get_weather", "parameters": {"city": "Oslo"}}]"#;
        let (content, calls) = t.extract(out, true);
        assert_eq!((content, calls.len(), calls[0].arguments.as_str()), (None, 1, r#"{"city":"Oslo"}"#));
        // Cut short by max_tokens: no call, the text is the content.
        assert_eq!(t.extract(&out[..20], false), (Some(out[..20].to_string()), vec![]));
    }

    #[test]
    fn required_keeps_each_tools_refs_resolvable() {
        let tools = json!([
            {"type": "function", "function": {"name": "a", "parameters": {"type": "object",
                "properties": {"p": {"$ref": "#/$defs/Point"}}, "$defs": {"Point": {"type": "object",
                "properties": {"x": {"type": "integer"}}}}}}},
            {"type": "function", "function": {"name": "b", "parameters": {"type": "object",
                "properties": {"next": {"$ref": "#"}, "p": {"$ref": "#/definitions/Point"}},
                "definitions": {"Point": {"type": "string"}}}}},
        ]);
        let t = Tools { mode: Mode::Required, ..parse(Some(&tools), None).expect("ok").expect("tools") };
        let Some(Constraint::JsonSchema(s)) = t.constraint() else { panic!("a schema") };
        let v: Value = serde_json::from_str(&s).expect("JSON");
        let defs = &v["$defs"];
        assert_eq!(defs["tool0"]["properties"]["p"]["$ref"], "#/$defs/tool0.Point");
        assert_eq!(defs["tool0.Point"]["properties"]["x"]["type"], "integer");
        assert_eq!(defs["tool1"]["properties"]["next"]["$ref"], "#/$defs/tool1");
        assert_eq!(defs["tool1"]["properties"]["p"]["$ref"], "#/$defs/tool1.Point");
        assert_eq!(defs["tool1.Point"]["type"], "string");
        assert!(defs["tool0"].get("$defs").is_none() && defs["tool1"].get("definitions").is_none());
    }

    #[test]
    fn streamed_text_holds_back_a_possible_tag() {
        let t = parse(Some(&weather()), None).expect("ok").expect("tools");
        let mut h = Holdback::new(t);
        let pieces = [
            "Sure",
            ", let me check <",
            "tool_",
            "call>\n{\"name\": \"get_weather\", ",
            "\"arguments\": {}}</tool_call>",
        ];
        let out: Vec<String> = pieces.iter().map(|p| h.push(p)).collect();
        assert_eq!(out, ["Sure", ", let me check ", "", "", ""]);
        let (content, calls) = h.finish(true);
        assert_eq!((content, calls.len()), (None, 1));
        let mut h = Holdback::new(parse(Some(&weather()), None).expect("ok").expect("tools"));
        assert_eq!(h.push("a < b"), "a < b");
        assert_eq!(h.push(" <tool"), " ");
        assert_eq!(h.finish(true), (Some("<tool".into()), vec![]));
    }

    #[test]
    fn messages_are_rewritten_for_templates_without_tools() {
        let t = parse(Some(&weather()), None).expect("ok").expect("tools");
        let calls = json!([{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]);
        let m = rewrite(
            Some(&t),
            vec![
                ("user".into(), "Weather?".into(), None),
                ("assistant".into(), String::new(), Some(calls)),
                ("tool".into(), "sunny".into(), None),
            ],
        );
        assert_eq!(m[0].0, "system");
        assert!(m[0].1.contains("<tools>") && m[0].1.contains("get_weather"), "{}", m[0].1);
        assert_eq!(m[2].1, "<tool_call>\n{\"name\":\"get_weather\",\"arguments\":{\"city\":\"Paris\"}}\n</tool_call>");
        assert_eq!(m[3], ("user".into(), "<tool_response>\nsunny\n</tool_response>".into()));
    }
}
