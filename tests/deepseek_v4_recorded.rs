//! The fixed-address decode step a GPU records (`model::deepseek_v4::recorded`: the plan
//! rewritten in place, closing-window lists padded with `NO_ENTRY`, the indexer's span
//! rounded up) gives the ordinary step's logits and expert counts bit for bit, on the CPU
//! backend (which takes that path when `records_steps` is set, and runs it eagerly), over
//! a generated schedule (`common::dsv4::assert_recorded_steps_match`). The GPU's graphs
//! are checked the same way in `cuda_dsv4_recorded.rs`.

mod common;

use common::dsv4::{CHECKPOINTS, assert_recorded_steps_match, dir};
use troupe::kernels::cpu::CpuBackend;
use troupe::model::deepseek_v4::DsV4Model;

fn model(name: &str, records_steps: bool) -> DsV4Model {
    let b = CpuBackend {
        records_steps,
        ..Default::default()
    };
    DsV4Model::load_dir_on(b, &dir(name), false).unwrap()
}

#[test]
fn the_fixed_address_decode_step_equals_the_ordinary_one_bit_for_bit() {
    for (seed, name) in CHECKPOINTS.iter().enumerate() {
        let decode_steps = assert_recorded_steps_match(
            name,
            &model(name, false),
            &model(name, true),
            0xc0de_0000 + seed as u64,
        );
        assert!(decode_steps > 100, "{name}: {decode_steps} decode steps");
    }
}
