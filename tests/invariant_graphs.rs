//! The batch-invariant mode on a shape wide and deep enough that its GEMMs split K
//! (Qwen3-0.6B's attention widths, one layer, dummy weights): decode steps recorded as
//! CUDA graphs give the tokens eager steps give, and no step fails on the way. The tiny
//! checkpoints never split K, so their runs do not reach the split sums' buffer; on the
//! CPU (no graphs) the two runs must agree all the same. With `TROUPE_TEST_DEVICE=cuda`
//! on the GPU machine.

mod common;

use common::engine::{random_requests, test_device};
use std::path::PathBuf;
use std::time::Duration;
use troupe::engine::{Engine, EngineConfig};

/// tiny-qwen3's config at Qwen3-0.6B's hidden size, heads and head size, one layer.
fn wide_config_dir() -> PathBuf {
    let src = common::goldens().join("tiny-qwen3/config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src).unwrap()).unwrap();
    for (key, value) in [
        ("hidden_size", 1024),
        ("intermediate_size", 1024),
        ("num_attention_heads", 16),
        ("num_key_value_heads", 8),
        ("head_dim", 128),
        ("num_hidden_layers", 1),
    ] {
        cfg[key] = value.into();
    }
    cfg["layer_types"] = serde_json::json!(["full_attention"]);
    let dir = common::scratch_dir("invariant-graphs");
    std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
    dir
}

async fn greedy_tokens(dir: &std::path::Path, enforce_eager: bool) -> Vec<Vec<u32>> {
    let mut cfg = EngineConfig::new(dir.to_path_buf());
    cfg.device = test_device();
    cfg.dummy_weights = true;
    cfg.batch_invariant = true;
    cfg.enforce_eager = enforce_eager;
    cfg.kv_cache_bytes = 64 << 20;
    let engine = Engine::spawn(cfg).await.unwrap();
    let requests = random_requests(5, 256, 41);
    let outs = tokio::time::timeout(Duration::from_secs(300), engine.generate_batch(requests))
        .await
        .expect("a batch of five short requests finishes");
    // The first start counts as one; a failed capture restarts the rank (and recomputes,
    // so the tokens alone could still agree).
    let resets = engine.status().await.unwrap().num_resets;
    assert!(
        resets <= 1,
        "enforce_eager {enforce_eager}: {resets} group starts"
    );
    engine.shutdown(true).await;
    outs.into_iter()
        .map(|o| {
            let o = o.unwrap();
            assert!(
                o.error.is_none(),
                "enforce_eager {enforce_eager}: {:?}",
                o.error
            );
            o.token_ids
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invariant_steps_recorded_as_graphs_give_the_eager_steps_tokens_where_gemms_split_k() {
    let dir = wide_config_dir();
    let recorded = greedy_tokens(&dir, false).await;
    let eager = greedy_tokens(&dir, true).await;
    assert!(recorded.iter().all(|t| !t.is_empty()));
    assert_eq!(recorded, eager);
    std::fs::remove_dir_all(&dir).unwrap();
}
