//! The unused tail of a prompt's last page: a page is reused across requests, so the slots
//! past the prompt still hold the previous owner's K and V. They are zeroed before the page
//! leaves for the decode node, so no other request's KV travels with it.

use ferry_kernels::KvLayout;
use ferry_transfer::memory::{HostPages, OutOfArena};

/// Zeroes the K and V slots `valid..page_size` of `page` in every layer (nothing when the
/// page is full or empty).
///
/// # Safety
/// The caller owns `page`: nobody else reads or writes it meanwhile.
pub unsafe fn zero_tail(mem: &HostPages, layout: &KvLayout, page: u32, valid: usize) -> Result<(), OutOfArena> {
    if valid == 0 || valid >= layout.page_size {
        return Ok(());
    }
    let elem = mem.page_bytes() / layout.page_floats().max(1);
    let tail = (layout.page_size - valid) * layout.slot_floats() * elem;
    let base = layout.offset(page, 0, false, 0);
    // SAFETY: the caller owns the page.
    let bytes = unsafe { mem.slice_mut(page, 1) }?;
    for layer in 0..layout.num_layers {
        for v in [false, true] {
            let from = (layout.offset(page, layer, v, valid) - base) * elem;
            bytes[from..from + tail].fill(0);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_slots_past_the_prompt_are_zeroed() {
        let layout = KvLayout { num_layers: 3, num_kv_heads: 2, head_dim: 4, page_size: 5 };
        let elem = 4;
        let mem = HostPages::new(layout.page_floats() * elem, 3).expect("arena");
        let ones = vec![1u8; layout.page_floats() * elem * 3];
        // SAFETY: the test owns the arena.
        unsafe { mem.write(0, &ones) }.expect("fill");
        unsafe { zero_tail(&mem, &layout, 1, 2) }.expect("zero");
        let all = unsafe { mem.read(0, 3) }.expect("read").to_vec();
        for page in 0..3u32 {
            for layer in 0..3 {
                for v in [false, true] {
                    for slot in 0..5 {
                        let at = layout.offset(page, layer, v, slot) * elem;
                        let cell = &all[at..at + layout.slot_floats() * elem];
                        let zeroed = page == 1 && slot >= 2;
                        assert!(
                            cell.iter().all(|&b| b == u8::from(!zeroed)),
                            "page {page} layer {layer} v {v} slot {slot}"
                        );
                    }
                }
            }
        }
        // Full and empty pages are left alone.
        unsafe { zero_tail(&mem, &layout, 2, 5) }.expect("full");
        unsafe { zero_tail(&mem, &layout, 2, 0) }.expect("empty");
        assert!(unsafe { mem.read(2, 1) }.expect("read").iter().all(|&b| b == 1));
    }
}
