//! The `rdma` backend: RC queue pairs, the decode node's page arena registered for remote
//! writes, each page run sent as one RDMA WRITE straight from the prefill node's arena into
//! the room's preallocated pages, and every chunk closed by a SEND with immediate data (the
//! room) carrying the runs' headers — room, secret, destination, length, CRC32C. RC delivers
//! a SEND after the WRITEs posted before it, so when the receiver sees the SEND the bytes are
//! in place: it checks each run against the room table and its checksum before it counts.
//!
//! The protocol is written against [`verbs::Verbs`]. [`mem::MemVerbs`] implements it in
//! memory, with failure injection, for tests on any machine; `IbVerbs` (feature `rdma`)
//! implements it on libibverbs and fails with a clear error when no device is present.
//!
//! What the receiver CPU cannot do with RDMA: refuse a WRITE. So nothing in the arena is
//! writable from the network but through memory windows ([`windows`]): a sender first shows a
//! live room's key in the connection exchange ([`cm`], inside the data plane's mutual TLS,
//! `crate::secure`), then asks for each room's grant with that room's key, once; the receiver
//! binds one window per run of the room's pages on that sender's queue pair and invalidates
//! them when the room ends or closes. A write anywhere else fails the queue pair and the rooms
//! it carried. The WRITEs and SENDs themselves are not encrypted (RDMA NICs carry them below
//! TLS): keep the RDMA fabric to the workers.

pub mod cm;
#[cfg(feature = "rdma")]
mod ibv;
pub mod mem;
mod receiver;
mod sender;
pub mod verbs;
mod windows;

use std::time::Duration;

#[cfg(feature = "rdma")]
pub use ibv::IbVerbs;
pub use receiver::RdmaReceiver;
pub use sender::RdmaSender;

use crate::room::Timeouts;

/// Settings of the rdma backend.
#[derive(Debug, Clone, Copy)]
pub struct RdmaConfig {
    /// Outstanding work requests per queue pair.
    pub depth: u32,
    /// Most pages in one RDMA WRITE (and one checksummed run).
    pub max_write_pages: u32,
    /// Bytes of one control message (a receive buffer).
    pub msg_bytes: u32,
    /// RECVs the receiver keeps posted per queue pair.
    pub recv_slots: u32,
    /// How long a send may wait for its completions.
    pub op_timeout: Duration,
    /// Room timeouts on the receiver.
    pub timeouts: Timeouts,
}

impl Default for RdmaConfig {
    fn default() -> Self {
        Self {
            depth: 256,
            max_write_pages: 64,
            msg_bytes: 4096,
            recv_slots: 64,
            op_timeout: Duration::from_secs(30),
            timeouts: Timeouts::default(),
        }
    }
}

/// RDMA devices on this machine (always 0 without the `rdma` feature).
pub fn device_count() -> usize {
    #[cfg(feature = "rdma")]
    {
        ibv::device_count()
    }
    #[cfg(not(feature = "rdma"))]
    {
        0
    }
}

/// Which of the devices named `names` (in `ibv_get_device_list`'s order) to open: the one
/// named `want`, or the first; an error naming what is missing otherwise.
pub fn pick_device(names: &[String], want: Option<&str>) -> Result<usize, verbs::VerbsError> {
    match want {
        None if names.is_empty() => Err(verbs::VerbsError::NoDevice(
            "no RDMA device on this machine (ibv_get_device_list found none); use --transfer tcp".into(),
        )),
        None => Ok(0),
        Some(want) => names.iter().position(|n| n == want).ok_or_else(|| {
            verbs::VerbsError::NoDevice(format!("no RDMA device named {want} ({} present)", names.len()))
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_device_is_picked_by_name_or_first_and_a_missing_one_is_named() {
        let names: Vec<String> = ["mlx5_0", "mlx5_1"].map(String::from).to_vec();
        assert_eq!(pick_device(&names, None), Ok(0));
        assert_eq!(pick_device(&names, Some("mlx5_1")), Ok(1));
        let e = pick_device(&names, Some("rxe0")).expect_err("not present").to_string();
        assert!(e.contains("no RDMA device named rxe0 (2 present)"), "{e}");
        let e = pick_device(&[], None).expect_err("none").to_string();
        assert!(e.contains("found none") && e.contains("--transfer tcp"), "{e}");
        assert!(pick_device(&[], Some("mlx5_0")).is_err());
    }
}
