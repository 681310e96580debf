//! A request's output constraint at run time: the grammar matcher, and the mask of tokens
//! allowed next, computed ahead of the forward pass that produces the logits it masks.

use ferry_grammar::{Grammars, Matcher, TokenMask};

use crate::EngineError;

/// A fresh guide for `params`' constraint, if it has one, from `grammars` (compiled now, or
/// copied from its cache), its first mask computed: workers call this on a blocking thread,
/// so the engine's thread neither compiles nor computes the first token's mask. A
/// constraint that does not compile is an invalid request.
pub fn guide(grammars: &Grammars, params: &ferry_tokenize::SamplingParams) -> Result<Option<Guide>, EngineError> {
    let Some(c) = &params.constraint else { return Ok(None) };
    let m = grammars.matcher(c).map_err(|e| EngineError::InvalidRequest(e.to_string()))?;
    let mut g = Guide::new(m);
    g.prepare();
    Ok(Some(g))
}

/// One request's constraint (see [`ferry_grammar`]): which tokens may come next.
pub struct Guide {
    /// Boxed: a matcher is over a kilobyte, and guides travel in commands.
    matcher: Box<Matcher>,
    /// The mask for the next token, when [`prepare`](Self::prepare)d.
    mask: Option<TokenMask>,
    /// Why the matcher failed, if it did: the request then ends (as if complete).
    error: Option<String>,
    /// The end-of-sequence tokens: all a failed matcher allows.
    eos: TokenMask,
}

impl std::fmt::Debug for Guide {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Guide").field("prepared", &self.mask.is_some()).field("error", &self.error).finish()
    }
}

impl Clone for Guide {
    fn clone(&self) -> Self {
        Self {
            matcher: Box::new(self.matcher.deep_clone()),
            mask: self.mask.clone(),
            error: self.error.clone(),
            eos: self.eos.clone(),
        }
    }
}

impl Guide {
    /// A guide over a fresh matcher (`ferry_grammar::Grammars::matcher`).
    pub fn new(matcher: Matcher) -> Self {
        let eos = matcher.tok_env().map(|e| e.tok_trie().eos_token_set()).unwrap_or_default();
        Self { matcher: Box::new(matcher), mask: None, error: None, eos }
    }

    /// Computes the next token's mask now if it is not yet known: the engine calls this on
    /// another thread while the forward pass runs.
    pub fn prepare(&mut self) {
        if self.mask.is_some() || self.error.is_some() {
            return;
        }
        match self.matcher.compute_mask_or_eos() {
            Ok(m) => self.mask = Some(m),
            Err(e) => self.error = Some(e.to_string()),
        }
    }

    /// Sets the logits of every token the constraint forbids next to −∞.
    pub fn apply(&mut self, logits: &mut [f32]) {
        self.prepare();
        let mask = self.mask.as_ref().unwrap_or(&self.eos);
        let words = mask.as_slice();
        for (w, chunk) in logits.chunks_mut(32).enumerate() {
            let bits = words.get(w).copied().unwrap_or(0);
            if bits == u32::MAX {
                continue;
            }
            for (b, l) in chunk.iter_mut().enumerate() {
                if bits & (1 << b) == 0 {
                    *l = f32::NEG_INFINITY;
                }
            }
        }
    }

    /// `token` was chosen (or forced): the matcher moves past it.
    pub fn advance(&mut self, token: u32) {
        self.mask = None;
        if self.error.is_none()
            && let Err(e) = self.matcher.consume_token(token)
        {
            self.error = Some(e.to_string());
        }
    }

    /// The tokens the constraint forces next, if it admits exactly one continuation (in the
    /// tokenizer's own tokenization of the forced text, llguidance leaving out a last token
    /// that what follows could merge with), taken as output: the matcher moves past them.
    /// At most `max` are taken.
    pub fn jump(&mut self, max: usize) -> Vec<u32> {
        if self.error.is_some() || max == 0 {
            return Vec::new();
        }
        let mut forced = self.matcher.compute_ff_tokens();
        forced.truncate(max);
        if forced.is_empty() {
            return forced;
        }
        self.mask = None;
        if let Err(e) = self.matcher.consume_tokens(&forced) {
            self.error = Some(e.to_string());
            return Vec::new();
        }
        forced
    }

    /// Whether the constraint is satisfied and admits nothing more (or failed): the request
    /// ends here, finish reason `stop`.
    pub fn complete(&self) -> bool {
        self.error.is_some() || self.matcher.is_stopped()
    }

    /// Why the matcher failed, if it did.
    pub fn error(&self) -> Option<&str> {
        self.error.as_deref()
    }
}
