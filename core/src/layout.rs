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
