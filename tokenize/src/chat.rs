//! Chat template rendering with the model's own Jinja template (minijinja, with Python
//! string-method compatibility for templates that call `.strip()` and friends).

use std::sync::Arc;

use crate::TokenizeError;

/// One chat message.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ChatMessage {
    /// "system", "user", "assistant", ...
    pub role: String,
    /// The text.
    pub content: String,
}

impl ChatMessage {
    /// A message with `role` and `content`.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self { role: role.into(), content: content.into() }
    }
}

/// A compiled chat template.
#[derive(Clone)]
pub struct ChatTemplate {
    env: Arc<minijinja::Environment<'static>>,
    /// The template reads a `tools` variable (it shows tools to the model itself).
    tools: bool,
    bos_token: String,
    eos_token: String,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate").field("bos_token", &self.bos_token).field("eos_token", &self.eos_token).finish()
    }
}

impl ChatTemplate {
    /// Compiles `source`; `bos_token` / `eos_token` are the texts the template may refer to.
    pub fn new(source: &str, bos_token: String, eos_token: String) -> Result<Self, TokenizeError> {
        let mut env = minijinja::Environment::new();
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> Result<String, minijinja::Error> {
            Err(minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, msg))
        });
        env.add_template_owned("chat", source.to_string()).map_err(|e| TokenizeError::Template(e.to_string()))?;
        let tools = source.contains("tools");
        Ok(Self { env: Arc::new(env), tools, bos_token, eos_token })
    }

    /// Whether the template reads `tools` (else a caller offering tools must describe them
    /// in the messages).
    pub fn supports_tools(&self) -> bool {
        self.tools
    }

    /// Renders messages given as JSON objects (`role`, `content`, and what tool-aware
    /// templates read: `tool_calls`, `tool_call_id`, `name`), with `tools` (OpenAI's tool
    /// objects) when some are offered.
    pub fn render_json(
        &self,
        messages: &[serde_json::Value],
        tools: Option<&[serde_json::Value]>,
        add_generation_prompt: bool,
    ) -> Result<String, TokenizeError> {
        let t = self.env.get_template("chat").map_err(|e| TokenizeError::Template(e.to_string()))?;
        t.render(minijinja::context! {
            messages => messages,
            tools => tools,
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token,
            eos_token => self.eos_token,
        })
        .map_err(|e| TokenizeError::Template(e.to_string()))
    }

    /// Renders `messages`; with `add_generation_prompt` the text ends where the assistant's
    /// answer begins.
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String, TokenizeError> {
        let t = self.env.get_template("chat").map_err(|e| TokenizeError::Template(e.to_string()))?;
        t.render(minijinja::context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token,
            eos_token => self.eos_token,
        })
        .map_err(|e| TokenizeError::Template(e.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_chatml_with_python_methods() {
        let src = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'].strip() }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";
        let t = ChatTemplate::new(src, String::new(), String::new()).expect("compiles");
        let out = t.render(&[ChatMessage::new("user", "  hi ")], true).expect("renders");
        assert_eq!(out, "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n");
    }

    #[test]
    fn raise_exception_is_an_error() {
        let t = ChatTemplate::new("{{ raise_exception('no system role') }}", String::new(), String::new())
            .expect("compiles");
        let e = t.render(&[], false).expect_err("raises");
        assert!(e.to_string().contains("no system role"));
    }
}
