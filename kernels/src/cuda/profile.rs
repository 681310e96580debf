//! Where a pass's time goes, operation by operation (`FERRY_CUDA_PROFILE=1`; off by default,
//! at the cost of one branch per call).
//!
//! A profiled call synchronises the stream before and after itself, so each operation is
//! timed alone: the host's share (until the call returns: table work, uploads, launches) and
//! the whole (until the device has finished it too). Synchronising slows the pass; the
//! figures rank operations, they are not the pass's unprofiled time.

use parking_lot::Mutex;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::CudaStream;

/// Calls, host time and total time per operation.
#[derive(Debug, Default, Clone, Copy)]
pub struct OpTime {
    /// Calls.
    pub calls: u64,
    /// Until the call returned.
    pub host: Duration,
    /// Until the device finished it.
    pub total: Duration,
}

/// The profile of one backend.
#[derive(Default)]
pub(super) struct Profile {
    ops: Mutex<BTreeMap<String, OpTime>>,
}

impl Profile {
    /// On when FERRY_CUDA_PROFILE=1.
    pub(super) fn from_env() -> Option<Self> {
        std::env::var("FERRY_CUDA_PROFILE").is_ok_and(|v| v == "1").then(Self::default)
    }

    pub(super) fn start<'a>(&'a self, stream: &'a Arc<CudaStream>, op: String) -> Timed<'a> {
        let _ = stream.synchronize();
        Timed { profile: self, stream, op, t0: Instant::now() }
    }

    pub(super) fn take(&self) -> Vec<(String, OpTime)> {
        let mut ops = self.ops.lock();
        std::mem::take(&mut *ops).into_iter().collect()
    }
}

/// One call being timed; records itself on drop.
pub(super) struct Timed<'a> {
    profile: &'a Profile,
    stream: &'a Arc<CudaStream>,
    op: String,
    t0: Instant,
}

impl Drop for Timed<'_> {
    fn drop(&mut self) {
        let host = self.t0.elapsed();
        let _ = self.stream.synchronize();
        let total = self.t0.elapsed();
        let mut ops = self.profile.ops.lock();
        let e = ops.entry(std::mem::take(&mut self.op)).or_default();
        e.calls += 1;
        e.host += host;
        e.total += total;
    }
}
