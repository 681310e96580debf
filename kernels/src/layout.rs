//! Where K and V live inside the page pool.
//!
//! Page-major layout: page `p` is one contiguous block of `page_floats()` values holding, for
//! each layer in turn, the K slots then the V slots of its `page_size` tokens; one slot is
//! `num_kv_heads * head_dim` values. A run of consecutive pages is therefore one contiguous
//! region of the pool, whatever the number of layers.

/// Shape of the KV page pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct KvLayout {
    /// Transformer layers.
    pub num_layers: usize,
    /// Key/value heads per layer.
    pub num_kv_heads: usize,
    /// Dimension of one head.
    pub head_dim: usize,
    /// Tokens per page.
    pub page_size: usize,
}

impl KvLayout {
    /// Values in one token's K (or V) for one layer.
    pub fn slot_floats(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }

    /// Values in one page (all layers, K and V).
    pub fn page_floats(&self) -> usize {
        self.num_layers * 2 * self.page_size * self.slot_floats()
    }

    /// Offset of the K (`v = false`) or V (`v = true`) slot of `slot` in `page`, layer `layer`.
    pub fn offset(&self, page: u32, layer: usize, v: bool, slot: usize) -> usize {
        let block = layer * 2 + usize::from(v);
        page as usize * self.page_floats() + (block * self.page_size + slot) * self.slot_floats()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pages_are_contiguous_and_disjoint() {
        let l = KvLayout { num_layers: 3, num_kv_heads: 2, head_dim: 4, page_size: 5 };
        let last = l.offset(0, 2, true, 4);
        assert_eq!(last + l.slot_floats(), l.page_floats());
        assert_eq!(l.offset(1, 0, false, 0), l.page_floats());
        assert_eq!(l.offset(0, 0, true, 0), 5 * 8);
    }
}
