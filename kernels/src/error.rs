//! Errors of the compute backends.

/// What a backend operation can fail with.
#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    /// Buffer or matrix sizes do not fit the operation.
    #[error("shape mismatch in {op}: {detail}")]
    Shape {
        /// The operation.
        op: &'static str,
        /// What did not fit.
        detail: String,
    },
    /// A token id is outside the embedding table.
    #[error("token id {id} is outside the vocabulary of {vocab}")]
    TokenOutOfRange {
        /// The offending id.
        id: u32,
        /// The vocabulary size.
        vocab: usize,
    },
    /// A page or slot is outside the pool.
    #[error("page {page} slot {slot} is outside the KV pool")]
    PageOutOfRange {
        /// Page id.
        page: u32,
        /// Slot within the page.
        slot: u32,
    },
    /// The device could not allocate memory.
    #[error("out of device memory allocating {bytes} bytes")]
    OutOfMemory {
        /// Requested size.
        bytes: usize,
    },
    /// The backend is not available on this machine.
    #[error("backend unavailable: {0}")]
    Unavailable(String),
}

/// Checks a size and returns a [`KernelError::Shape`] naming `op` when it is wrong.
pub(crate) fn check(op: &'static str, ok: bool, detail: impl FnOnce() -> String) -> Result<(), KernelError> {
    if ok { Ok(()) } else { Err(KernelError::Shape { op, detail: detail() }) }
}
