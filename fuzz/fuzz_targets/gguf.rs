//! GGUF model files: any bytes as a `.gguf` file through the router's model reader
//! (`ServedModel::load`: header, metadata, tokenizer) and the engine's loader (`Model::load`:
//! tensors, shapes, quantized blocks). Errors are fine; panics and reads out of bounds are not.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("m.gguf");
    std::fs::write(&path, data).expect("write");
    let _ = ferry_tokenize::gguf::parse(data);
    let _ = ferry_tokenize::ServedModel::load(&path);
    let _ = ferry_engine::Model::load(&path, ferry_kernels::cpu::CpuBackend::default());
});
