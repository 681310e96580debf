//! The KV layout a prefill node and a decode node must share for pages to move between them.

/// What a node's KV pages look like.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct LayoutDescriptor {
    /// The model's fingerprint (architecture and weights).
    pub model_fingerprint: String,
    /// Element type of the pages ("f32", "bf16", ...).
    pub dtype: String,
    /// Transformer layers.
    pub num_layers: u32,
    /// KV heads per layer.
    pub num_kv_heads: u32,
    /// Dimension of one head.
    pub head_dim: u32,
    /// Tokens per page.
    pub page_size: u32,
}

impl LayoutDescriptor {
    /// Why `other` cannot receive pages laid out as `self`, or None when they match.
    pub fn mismatch(&self, other: &Self) -> Option<String> {
        let fields = [
            ("model_fingerprint", self.model_fingerprint.clone(), other.model_fingerprint.clone()),
            ("dtype", self.dtype.clone(), other.dtype.clone()),
            ("num_layers", self.num_layers.to_string(), other.num_layers.to_string()),
            ("num_kv_heads", self.num_kv_heads.to_string(), other.num_kv_heads.to_string()),
            ("head_dim", self.head_dim.to_string(), other.head_dim.to_string()),
            ("page_size", self.page_size.to_string(), other.page_size.to_string()),
        ];
        let diffs: Vec<String> =
            fields.iter().filter(|(_, a, b)| a != b).map(|(n, a, b)| format!("{n} {a} vs {b}")).collect();
        (!diffs.is_empty()).then(|| format!("KV layout mismatch: {}", diffs.join(", ")))
    }
}

/// Pages of a `prompt`-token prompt that the sequences forked from it (`n` > 1) share: its
/// whole pages but the one holding its last token, which each sequence writes.
pub fn fork_shared_pages(prompt: usize, page_size: usize) -> usize {
    prompt.div_ceil(page_size.max(1)).saturating_sub(1)
}

/// KV pages `n` sequences of a `prompt`-token prompt need when each holds `context` tokens
/// (prompt included): the shared pages once, the rest `n` times.
pub fn fork_pages(prompt: usize, context: usize, n: usize, page_size: usize) -> usize {
    let one = context.div_ceil(page_size.max(1));
    let shared = fork_shared_pages(prompt, page_size).min(one);
    shared + n.max(1) * (one - shared)
}

#[cfg(test)]
mod fork_tests {
    use super::{fork_pages, fork_shared_pages};

    #[test]
    fn forked_sequences_share_the_prompts_pages_but_the_last() {
        assert_eq!(fork_shared_pages(400, 16), 24);
        assert_eq!(fork_shared_pages(32, 16), 1, "a whole last page is written too");
        assert_eq!(fork_shared_pages(1, 16), 0);
        assert_eq!(fork_pages(400, 408, 8, 16), 40);
        assert_eq!(fork_pages(400, 408, 1, 16), 26);
    }
}
