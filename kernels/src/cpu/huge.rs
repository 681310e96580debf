//! Transparent huge pages for the CPU's big buffers: the KV arena and the weight matrices are
//! read across on every step, and with 4 KiB pages every 4 KiB of them costs a TLB entry
//! (a batch-1 decode step streams every weight once). Linux backs a range with 2 MiB pages
//! where transparent huge pages are `always` or `madvise` (the common default) and the range
//! is advised. Best effort: where an administrator set them to `never`, on kernels without a
//! call, or when no free 2 MiB page is found, nothing changes.

/// Bytes in a huge page.
const HUGE: usize = 2 << 20;

/// The whole huge pages inside `[ptr, ptr + len)`: their start and length, if any.
pub(crate) fn inside(ptr: *const u8, len: usize) -> Option<(usize, usize)> {
    let start = (ptr as usize).checked_next_multiple_of(HUGE)?;
    let end = (ptr as usize).saturating_add(len) / HUGE * HUGE;
    (end > start).then(|| (start, end - start))
}

/// Advises the whole huge pages inside `[ptr, ptr + len)`, before their first touch, so that
/// faulting them in brings huge pages.
pub(crate) fn advise(ptr: *const u8, len: usize) {
    #[cfg(target_os = "linux")]
    if let Some((start, n)) = inside(ptr, len) {
        // SAFETY: advice on pages of the caller's own allocation; MADV_HUGEPAGE changes no
        // contents.
        unsafe { libc::madvise(start as *mut libc::c_void, n, libc::MADV_HUGEPAGE) };
    }
    #[cfg(not(target_os = "linux"))]
    let _ = inside(ptr, len);
}

/// [`advise`] for memory already written (a weight matrix once built): besides the advice,
/// asks the kernel to move the range onto huge pages now (`MADV_COLLAPSE`, Linux 6.1 and
/// later) rather than whenever its background scan comes by.
pub(crate) fn collapse<T>(values: &[T]) {
    let (ptr, len) = (values.as_ptr().cast::<u8>(), std::mem::size_of_val(values));
    advise(ptr, len);
    // MADV_COLLAPSE ignores the system's setting: honour an administrator's `never`.
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    if !never()
        && let Some((start, n)) = inside(ptr, len)
    {
        // SAFETY: as in `advise`: MADV_COLLAPSE copies pages into huge ones, contents kept.
        unsafe { libc::madvise(start as *mut libc::c_void, n, libc::MADV_COLLAPSE) };
    }
}

/// Whether transparent huge pages are set to `never` (read once).
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn never() -> bool {
    static NEVER: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *NEVER.get_or_init(|| {
        std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled").is_ok_and(|s| s.contains("[never]"))
    })
}

/// The `VmFlags` of the mapping holding `addr` (/proc/self/smaps): `hg` marks advised memory.
#[cfg(all(test, target_os = "linux"))]
pub(crate) fn vm_flags_at(addr: usize) -> Vec<String> {
    let smaps = std::fs::read_to_string("/proc/self/smaps").expect("smaps");
    let mut inside = false;
    for line in smaps.lines() {
        if let Some((range, _)) = line.split_once(' ')
            && let Some((a, b)) = range.split_once('-')
            && let (Ok(a), Ok(b)) = (usize::from_str_radix(a, 16), usize::from_str_radix(b, 16))
        {
            inside = (a..b).contains(&addr);
        } else if inside && let Some(flags) = line.strip_prefix("VmFlags:") {
            return flags.split_whitespace().map(str::to_string).collect();
        }
    }
    Vec::new()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_whole_huge_pages_are_advised() {
        assert_eq!(inside(HUGE as *const u8, HUGE), Some((HUGE, HUGE)));
        assert_eq!(inside((HUGE + 1) as *const u8, 3 * HUGE), Some((2 * HUGE, 2 * HUGE)));
        assert_eq!(inside((HUGE + 1) as *const u8, 2 * HUGE - 2), None, "no whole huge page inside");
        assert_eq!(inside(usize::MAX as *const u8, 10), None);
    }
}
