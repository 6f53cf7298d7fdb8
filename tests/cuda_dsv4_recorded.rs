//! DeepSeek-V4 decode steps recorded as CUDA graphs (`model::deepseek_v4::recorded`) give
//! the eager steps' logits and expert counts bit for bit over a generated schedule
//! (`common::dsv4::assert_recorded_steps_match`), and most of them are replays. Needs a
//! GPU: run by `scripts/gpu-moe.sh tests` on the device machine.
#![cfg(feature = "cuda")]

mod common;

use common::dsv4::{CHECKPOINTS, assert_recorded_steps_match, dir};
use troupe::kernels::cuda::CudaBackend;
use troupe::model::deepseek_v4::DsV4Model;

fn model(name: &str, record: bool) -> DsV4Model<CudaBackend> {
    let b = CudaBackend::new(0, false, record).expect("a GPU");
    DsV4Model::load_dir_on(b, &dir(name), false).unwrap()
}

#[test]
fn recorded_decode_steps_equal_eager_steps_bit_for_bit() {
    for (seed, name) in CHECKPOINTS.iter().enumerate() {
        let eager = model(name, false);
        let recorded = model(name, true);
        let decode_steps =
            assert_recorded_steps_match(name, &eager, &recorded, 0x5eed_0000 + seed as u64);
        let replayed = recorded.backend.replayed_steps() as usize;
        assert!(
            replayed * 2 >= decode_steps,
            "{name}: only {replayed} of {decode_steps} decode steps were replayed"
        );
        assert_eq!(
            eager.backend.replayed_steps(),
            0,
            "{name}: the eager model recorded"
        );
    }
}
