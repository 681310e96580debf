//! A request's text as it streams out: tokens detokenized incrementally, stop strings found
//! across token boundaries (a suffix that may begin one is held back until the next token
//! decides), and the text cut where a stop string starts.

use ferry_tokenize::{Detokenizer, ServedModel};

/// The longest suffix of `text` that is a proper prefix of some stop string (held back in
/// case the next token completes it).
fn held_back(text: &str, stop: &[String]) -> usize {
    let mut keep = 0;
    for s in stop {
        for (i, _) in s.char_indices().skip(1) {
            if text.ends_with(&s[..i]) {
                keep = keep.max(i);
            }
        }
    }
    keep
}

/// Incremental text with stop strings.
pub(crate) struct Output<'a> {
    model: &'a ServedModel,
    detok: Detokenizer,
    stop: &'a [String],
    /// Text decoded but not yet sent (it may be the start of a stop string).
    pending: String,
    stopped: bool,
}

impl<'a> Output<'a> {
    pub(crate) fn new(model: &'a ServedModel, stop: &'a [String]) -> Self {
        Self { model, detok: Detokenizer::new(true), stop, pending: String::new(), stopped: false }
    }

    /// Adds tokens; returns the text that can go out now, and whether a stop string ended it.
    pub(crate) fn push(&mut self, ids: &[u32]) -> (String, bool) {
        if self.stopped {
            return (String::new(), true);
        }
        for &id in ids {
            if let Ok(t) = self.detok.push(&self.model.tokenizer, id) {
                self.pending.push_str(&t);
            }
        }
        if let Some(at) = self.stop.iter().filter_map(|s| self.pending.find(s.as_str())).min() {
            self.stopped = true;
            self.pending.truncate(at);
            return (std::mem::take(&mut self.pending), true);
        }
        let keep = held_back(&self.pending, self.stop);
        let out = self.pending[..self.pending.len() - keep].to_string();
        self.pending.drain(..self.pending.len() - keep);
        (out, false)
    }

    pub(crate) fn flush(&mut self) -> String {
        if !self.stopped
            && let Ok(t) = self.detok.flush(&self.model.tokenizer)
        {
            self.pending.push_str(&t);
        }
        std::mem::take(&mut self.pending)
    }
}

#[cfg(test)]
mod tests {
    use super::held_back;

    #[test]
    fn stop_string_prefixes_are_held_back() {
        let stop = vec!["</end>".to_string(), "STOP".to_string()];
        assert_eq!(held_back("hello </e", &stop), 3);
        assert_eq!(held_back("hello ST", &stop), 2);
        assert_eq!(held_back("hello", &stop), 0);
        assert_eq!(held_back("x<", &stop), 1);
    }
}
