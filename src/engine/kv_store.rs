//! Opening the prefix store (`--kv-host-cache-bytes`, `--kv-store-dir`): what cannot use
//! it refused by name, its namespace from the model and every setting its bytes depend on.

use super::pools::Pools;
use super::{EngineConfig, EngineError};
use crate::kernels::Device;
use crate::model::config::ModelConfig;
use crate::store::{self, KvStore};
use crate::sync::Shared;

/// The block layout's version: a change to what a block's bytes mean is a new namespace.
const KV_LAYOUT_VERSION: u32 = 1;

/// The store `cfg` asks for, or `None`; why it cannot run, by flag.
pub(super) fn open_kv_store(
    cfg: &EngineConfig,
    mcfg: &ModelConfig,
    pools: &Pools,
    deepseek_v4: bool,
    draft: bool,
) -> Result<Option<Shared<KvStore>>, EngineError> {
    let store = &cfg.kv_store;
    if !store.enabled() {
        return Ok(None);
    }
    let refuse = |why: &str| {
        Err(EngineError::Spawn(format!(
            "--kv-store-dir / --kv-host-cache-bytes: {why}"
        )))
    };
    if !cfg.enable_prefix_cache {
        return refuse("the store keeps prefix-cache blocks, and the prefix cache is off");
    }
    if deepseek_v4 && cfg.device != Device::Cpu {
        return refuse("DeepSeek-V4's blocks are copied out on the CPU only so far");
    }
    if cfg.tensor_parallel_size > 1 {
        return refuse("one rank only (each rank of a group holds a shard of every block)");
    }
    if draft {
        return refuse("--spec draft keeps a second cache the store does not hold");
    }
    if store.dir.is_some() && store.disk_bytes == 0 {
        return refuse("--kv-store-bytes must be positive with --kv-store-dir");
    }
    let device = match cfg.device {
        Device::Cpu => "cpu".to_string(),
        Device::Cuda(_) => "cuda".to_string(),
    };
    // Everything a block's bytes depend on: another value is another namespace. The
    // model's path too (two checkpoints alike in size, config, first and last MiB stay
    // apart), and the layout's version.
    let model_path = std::fs::canonicalize(&cfg.model_path).unwrap_or(cfg.model_path.clone());
    let settings = format!(
        "layout {KV_LAYOUT_VERSION} path {} {mcfg:?} block {} kv {} device {device} \
         invariant {} exact {} quantization {:?} dummy {}",
        model_path.display(),
        pools.block_size,
        cfg.kv_cache_dtype.name(),
        cfg.batch_invariant,
        cfg.exact_activations,
        cfg.quantization,
        cfg.dummy_weights,
    );
    let namespace = store::namespace(&cfg.model_path, &settings).map_err(|e| {
        EngineError::Spawn(format!(
            "kv store: reading {}: {e}",
            cfg.model_path.display()
        ))
    })?;
    let opened =
        KvStore::open(store, &namespace, pools.block_size, pools.block_bytes).map_err(|e| {
            let dir = store.dir.as_ref().map(|d| d.display().to_string());
            EngineError::Spawn(format!("--kv-store-dir {}: {e}", dir.unwrap_or_default()))
        })?;
    Ok(Some(Shared::new(
        opened.with_state_bytes(pools.state_bytes),
    )))
}
