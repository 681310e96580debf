//! safetensors model files: any bytes as the `model.safetensors` of a very small Llama
//! directory (its config.json and tokenizer kept), through the engine's loader (`Model::load`:
//! header, dtypes, shapes, offsets). Errors are fine; panics and reads out of bounds are not.
#![no_main]

use std::sync::OnceLock;

use ferry_engine::tiny::{TinySpec, write_hf};
use libfuzzer_sys::fuzz_target;

/// The very small model's directory (the same spec as `tiny_model --small`).
fn template() -> &'static tempfile::TempDir {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    DIR.get_or_init(|| {
        let d = tempfile::tempdir().expect("temp dir");
        let spec = TinySpec {
            hidden: 8,
            ffn: 16,
            layers: 1,
            heads: 2,
            kv_heads: 1,
            ctx: 64,
            merges: 4,
            ..TinySpec::default()
        };
        write_hf(d.path(), &spec).expect("tiny model");
        d
    })
}

fuzz_target!(|data: &[u8]| {
    let dir = template().path();
    std::fs::write(dir.join("model.safetensors"), data).expect("write");
    let _ = ferry_engine::Model::load(dir, ferry_kernels::cpu::CpuBackend::default());
});
