//! What a request asks for, and how it ended.

/// How to choose each next token. `Default` is greedy decoding of up to 128 tokens.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy (argmax).
    pub temperature: f32,
    /// Keep the `top_k` most likely tokens; 0 keeps all.
    pub top_k: u32,
    /// Keep the smallest set of tokens whose probability reaches `top_p`; 1 keeps all.
    pub top_p: f32,
    /// Drop tokens less likely than `min_p` times the most likely one; 0 keeps all.
    pub min_p: f32,
    /// Divide positive (multiply negative) logits of tokens already seen; 1 disables.
    pub repetition_penalty: f32,
    /// Subtract `frequency_penalty × count` from the logit of each generated token.
    pub frequency_penalty: f32,
    /// Subtract `presence_penalty` from the logit of each token generated at least once.
    pub presence_penalty: f32,
    /// Seed of this request's random stream; `None` draws one.
    pub seed: Option<u64>,
    /// Tokens to generate at most.
    pub max_new_tokens: u32,
    /// Token ids that end generation, beside the model's end-of-sequence ids.
    pub stop_token_ids: Vec<u32>,
    /// How many top alternatives to report with each token.
    pub top_logprobs: u32,
    /// Keep generating past end-of-sequence ids.
    pub ignore_eos: bool,
    /// What the output must be (JSON, a schema, a regex, one of some strings); `None` is
    /// free text.
    pub constraint: Option<Constraint>,
    /// Report the logprob of every prompt token after the first under the model, with this
    /// many alternatives each (`echo` with `logprobs`); `None`: not asked. The prompt is then
    /// computed whole: a cached prefix has no logits to report.
    pub prompt_logprobs: Option<u32>,
    /// Sequences generated from the prompt (OpenAI's `n`): with more than one, the prompt is
    /// prefilled once and the decode worker forks it; sequence `i` samples with its own
    /// random stream (`seed + i` when a seed is set). 1 to [`MAX_N`].
    pub n: u32,
    /// Added to these tokens' logits before every draw (OpenAI's `logit_bias`), by token id
    /// in ascending order: each bias in [-100, 100], at most [`MAX_LOGIT_BIAS`] ids.
    pub logit_bias: Vec<(u32, f32)>,
    /// The last `resumed` prompt tokens are this request's own output, generated elsewhere
    /// before it moved here (a migration: its decode worker died or drained): the sampler
    /// counts them as output — the penalties, the output constraint and the random stream
    /// (one draw each at a temperature above 0) — so the rest is what an undisturbed run
    /// would have generated. `max_new_tokens` is what is left. 0: a fresh request. Only with
    /// `n` = 1 and without prompt logprobs.
    pub resumed: u32,
}

/// A constraint on the whole output, enforced token by token (structured outputs): every
/// step masks the tokens that cannot continue it, and generation ends once it is complete.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Constraint {
    /// Any JSON object (OpenAI `response_format: {"type": "json_object"}`).
    JsonObject,
    /// JSON valid against this JSON Schema, given as its JSON text.
    JsonSchema(String),
    /// Text matching this regular expression, whole.
    Regex(String),
    /// Exactly one of these strings.
    Choice(Vec<String>),
}

impl Constraint {
    /// A short name for metrics and logs.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::JsonObject => "json_object",
            Self::JsonSchema(_) => "json_schema",
            Self::Regex(_) => "regex",
            Self::Choice(_) => "choice",
        }
    }
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
            seed: None,
            max_new_tokens: 128,
            stop_token_ids: Vec::new(),
            top_logprobs: 0,
            ignore_eos: false,
            constraint: None,
            prompt_logprobs: None,
            n: 1,
            logit_bias: Vec::new(),
            resumed: 0,
        }
    }
}

/// Most sequences one request may ask for (`n`).
pub const MAX_N: u32 = 64;

/// Most alternatives a request may ask for per token.
pub const MAX_TOP_LOGPROBS: u32 = 20;

/// Most token ids one request may bias (`logit_bias`).
pub const MAX_LOGIT_BIAS: usize = 1024;

/// A sampling parameter out of its range.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("invalid sampling parameter {name} = {value}: {rule}")]
pub struct SamplingError {
    /// The parameter.
    pub name: &'static str,
    /// Its value, printed.
    pub value: String,
    /// The rule it breaks.
    pub rule: &'static str,
}

impl SamplingParams {
    /// The parameters of sequence `i` of a request with `n` > 1: its own random stream
    /// (`seed + i`; sequence 0 is the request itself), one sequence, and no prompt logprobs
    /// (the prompt is reported once, with sequence 0).
    pub fn sequence(&self, i: u32) -> SamplingParams {
        SamplingParams {
            seed: self.seed.map(|s| s.wrapping_add(u64::from(i))),
            n: 1,
            prompt_logprobs: if i == 0 { self.prompt_logprobs } else { None },
            ..self.clone()
        }
    }

    /// Checks every parameter's range; `vocab` bounds the stop token ids.
    pub fn validate(&self, vocab: usize) -> Result<(), SamplingError> {
        let err =
            |name, value: &dyn std::fmt::Display, rule| Err(SamplingError { name, value: value.to_string(), rule });
        let t = self.temperature;
        if !t.is_finite() || !(0.0..=100.0).contains(&t) {
            return err("temperature", &t, "must be in [0, 100]");
        }
        if !(self.top_p.is_finite() && self.top_p > 0.0 && self.top_p <= 1.0) {
            return err("top_p", &self.top_p, "must be in (0, 1]");
        }
        if !self.min_p.is_finite() || !(0.0..=1.0).contains(&self.min_p) {
            return err("min_p", &self.min_p, "must be in [0, 1]");
        }
        if !self.repetition_penalty.is_finite() || self.repetition_penalty <= 0.0 {
            return err("repetition_penalty", &self.repetition_penalty, "must be positive");
        }
        for (name, v) in [("frequency_penalty", self.frequency_penalty), ("presence_penalty", self.presence_penalty)] {
            if !v.is_finite() || !(-2.0..=2.0).contains(&v) {
                return err(name, &v, "must be in [-2, 2]");
            }
        }
        if self.max_new_tokens == 0 {
            return err("max_new_tokens", &0, "must be at least 1");
        }
        if self.top_logprobs > MAX_TOP_LOGPROBS {
            return err("top_logprobs", &self.top_logprobs, "must be at most 20");
        }
        if let Some(k) = self.prompt_logprobs.filter(|&k| k > MAX_TOP_LOGPROBS) {
            return err("prompt_logprobs", &k, "must be at most 20");
        }
        if !(1..=MAX_N).contains(&self.n) {
            return err("n", &self.n, "must be in [1, 64]");
        }
        if let Some(id) = self.stop_token_ids.iter().find(|&&id| id as usize >= vocab) {
            return err("stop_token_ids", id, "must be inside the vocabulary");
        }
        if self.logit_bias.len() > MAX_LOGIT_BIAS {
            return err("logit_bias", &format!("{} ids", self.logit_bias.len()), "may hold at most 1024 token ids");
        }
        if let Some((id, _)) = self.logit_bias.iter().find(|&&(id, _)| id as usize >= vocab) {
            return err("logit_bias", id, "token ids must be inside the vocabulary");
        }
        if let Some(w) = self.logit_bias.windows(2).find(|w| w[0].0 >= w[1].0) {
            return err("logit_bias", &w[1].0, "token ids must be unique, in ascending order");
        }
        if self.resumed > 0 && (self.n > 1 || self.prompt_logprobs.is_some()) {
            return err("resumed", &self.resumed, "needs n = 1 and no prompt_logprobs");
        }
        if let Some((id, b)) = self.logit_bias.iter().find(|&&(_, b)| !(b.is_finite() && (-100.0..=100.0).contains(&b)))
        {
            return err("logit_bias", &format!("{b} (token {id})"), "each bias must be in [-100, 100]");
        }
        Ok(())
    }
}

/// Why generation stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FinishReason {
    /// An end-of-sequence or stop token (or stop string) was produced.
    Stop,
    /// `max_new_tokens` or the context length was reached.
    Length,
    /// The request was aborted.
    Abort,
}

impl FinishReason {
    /// The OpenAI-style name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Stop => "stop",
            Self::Length => "length",
            Self::Abort => "abort",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid_and_ranges_are_checked() {
        assert!(SamplingParams::default().validate(10).is_ok());
        let bad = [
            SamplingParams { temperature: -1.0, ..Default::default() },
            SamplingParams { temperature: f32::NAN, ..Default::default() },
            SamplingParams { top_p: 0.0, ..Default::default() },
            SamplingParams { min_p: 2.0, ..Default::default() },
            SamplingParams { repetition_penalty: 0.0, ..Default::default() },
            SamplingParams { presence_penalty: 3.0, ..Default::default() },
            SamplingParams { max_new_tokens: 0, ..Default::default() },
            SamplingParams { top_logprobs: 21, ..Default::default() },
            SamplingParams { stop_token_ids: vec![10], ..Default::default() },
            SamplingParams { logit_bias: vec![(10, 1.0)], ..Default::default() },
            SamplingParams { logit_bias: vec![(3, 100.5)], ..Default::default() },
            SamplingParams { logit_bias: vec![(3, f32::NAN)], ..Default::default() },
            SamplingParams { logit_bias: vec![(3, 1.0); MAX_LOGIT_BIAS + 1], ..Default::default() },
            SamplingParams { logit_bias: vec![(3, 1.0), (3, 2.0)], ..Default::default() },
            SamplingParams { logit_bias: vec![(4, 1.0), (3, 2.0)], ..Default::default() },
        ];
        for p in bad {
            assert!(p.validate(10).is_err(), "{p:?}");
        }
        let ends = SamplingParams { logit_bias: vec![(0, -100.0), (9, 100.0)], ..Default::default() };
        assert!(ends.validate(10).is_ok());
    }
}
