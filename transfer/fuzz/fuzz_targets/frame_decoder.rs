//! Fuzzes the data-plane frame decoder and the receiver's room table with arbitrary bytes:
//! decoding must never panic, accepted headers must respect the limits, and no sequence of
//! frames may make the table accept a page outside the room or the same page twice.
#![no_main]

use std::time::Instant;

use ferry_core::{Room, RoomSecret};
use ferry_transfer::frame::{Aux, HEADER_LEN, Header, Kind, Limits};
use ferry_transfer::room::Timeouts;
use ferry_transfer::table::RoomTable;
use libfuzzer_sys::fuzz_target;

const LIMITS: Limits = Limits { page_bytes: 64, max_payload: 64 * 8 };

fuzz_target!(|data: &[u8]| {
    let now = Instant::now();
    let mut table = RoomTable::new(Timeouts::default());
    let dest = [3u32, 4, 5, 9];
    let (room, secret) = (Room::from(1u32), RoomSecret::from([7; 16]));
    let _ = table.open(room, secret, &dest, now);
    let mut accepted = std::collections::HashSet::new();
    for (i, chunk) in data.chunks(HEADER_LEN).enumerate() {
        let mut b = [0u8; HEADER_LEN];
        b[..chunk.len()].copy_from_slice(chunk);
        // Every other chunk gets a valid magic and header checksum, so the fuzzer reaches the
        // length, kind and room checks behind them (random bytes almost never would).
        if i % 2 == 1 {
            b[0..4].copy_from_slice(b"FRY1");
            let crc = crc32c::crc32c(&b[..48]);
            b[48..52].copy_from_slice(&crc.to_le_bytes());
        }
        let Ok(h) = Header::decode(&b, &LIMITS) else { continue };
        assert!(h.payload_len <= LIMITS.max_payload.max(4096));
        match h.kind {
            Kind::Pages => {
                if let Ok(c) = table.claim(&h, now) {
                    assert_eq!((c.room, h.secret), (room, secret));
                    for p in c.first..c.first + c.n {
                        assert!(dest.contains(&p), "page outside the room");
                        assert!(accepted.insert(p), "page accepted twice");
                    }
                    table.commit(c, now);
                }
            }
            Kind::Done => {
                if table.check_control(&h).is_ok() {
                    if let Some(aux) = Aux::decode(&chunk[..chunk.len().min(20)]) {
                        table.done(room, aux, now);
                    }
                }
            }
            Kind::Abort => {}
        }
    }
    let _ = table.drain_ended();
});
