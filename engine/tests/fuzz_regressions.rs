//! Inputs the `gguf` fuzz target once crashed on: each must now be a clean error.

#[test]
fn a_gguf_claiming_absurdly_many_layers_is_an_error() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("m.gguf");
    std::fs::write(&path, include_bytes!("fuzz-regressions/gguf-huge-layer-count.bin")).expect("write");
    let Err(e) = ferry_engine::Model::load(&path, ferry_kernels::cpu::CpuBackend::default()) else { panic!("loaded") };
    assert!(e.to_string().contains("inconsistent architecture"), "{e}");
}
