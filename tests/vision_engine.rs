//! Qwen2.5-VL through the engine (issue 64), on the generated checkpoints of
//! `scripts/make_vision_goldens.py`: prompts with images beside text-only requests, their
//! prefills cut through images, prefix hits on a repeated image and none on another image
//! under the same placeholders, and sequences with images preempted and recomputed — greedy
//! tokens equal transformers' throughout.

mod common;

use std::time::Duration;

use common::vision::{
    Prompt, Reference, case_dir, cases_json, encoder, exact, greedy_of, load_model, patches_of,
    request,
};
use troupe::api::EngineRequest;
use troupe::engine::{Engine, EngineConfig};
use troupe::model::vision::ImageSpan;
use troupe::sampling::SamplingParams;

/// Through the engine: the image prompts of a case beside text-only requests, prefills
/// cut into chunks of 7 tokens (through images), then again for prefix hits — greedy
/// tokens equal transformers'. The same placeholders over another image of the same grid
/// take no hit from the first: they give that image's tokens.
#[test]
fn the_engine_serves_images_beside_text() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        tokio::time::timeout(Duration::from_secs(120), async {
            let dir = case_dir("a");
            let reference = Reference::open(&dir);
            let cases = cases_json(&dir);
            let image_token = cases["image_token_id"].as_u64().unwrap() as u32;
            let mut cfg = EngineConfig::new(dir.clone());
            cfg.kv_cache_bytes = 8 << 20;
            cfg.max_step_tokens = 7;
            // Blocks of 4: an image's placeholders fill whole blocks, which could be hits.
            cfg.block_size = 4;
            cfg.exact_activations = true;
            let engine = Engine::spawn(cfg).await.unwrap();
            let prompts = cases["prompts"].as_array().unwrap();
            let want: Vec<Vec<u32>> = (0..prompts.len())
                .map(|p| reference.ints(&format!("greedy_{p}")))
                .collect();
            for round in 0..2 {
                let mut requests: Vec<EngineRequest> = prompts
                    .iter()
                    .map(|p| request(&dir, p, image_token, 8))
                    .collect();
                let mut text = EngineRequest::new((1..30).collect(), 8, SamplingParams::default());
                text.ignore_eos = true;
                requests.push(text);
                let out = common::engine::ok_outputs(&engine, requests).await;
                for (p, want) in want.iter().enumerate() {
                    assert_eq!(&out[p].token_ids, want, "round {round}, prompt {p}");
                }
            }
            let status = engine.status().await.unwrap();
            assert!(status.num_prefix_hit_blocks > 0, "{status:?}");
            // Each image once, whichever of the encoder actor and the rank came first.
            assert_eq!(status.num_encoded_images, 4, "{status:?}");
            assert!(status.num_image_cache_hits > 0, "{status:?}");
            // Images 1 and 3 of case "a" share a grid: the same prompt ids over either.
            let enc = encoder(&dir);
            let backend = exact();
            let mut model = load_model(&dir, &backend);
            for image in [1usize, 3] {
                let p = serde_json::json!({"ids": prompts[0]["ids"], "images": [image]});
                let r = request(&dir, &p, image_token, 4);
                assert_eq!(r.images[0].grid, patches_of(&dir, 1).grid);
                let got = common::engine::ok_outputs(&engine, vec![r.clone()]).await;
                // The model's own pass, checked against transformers above.
                let prompt = Prompt {
                    ids: r.prompt_ids.clone(),
                    spans: vec![ImageSpan {
                        start: r.images[0].first_token,
                        grid: r.images[0].token_grid(),
                    }],
                    embeds: vec![enc.encode(&patches_of(&dir, image))],
                };
                let want = greedy_of(&mut model, &backend, &prompt, 4);
                assert_eq!(got[0].token_ids, want, "image {image}");
            }
            engine.shutdown(true).await;
        })
        .await
        .expect("the engine answered within 120 s");
    });
}

/// More sequences with images than the KV pool holds: some are preempted mid-prefill or
/// mid-decode and recomputed (their images encoded again, or found in the rank's cache),
/// and every one still gives transformers' greedy tokens; the pool is whole afterwards.
#[test]
fn sequences_with_images_preempted_give_the_same_tokens() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        tokio::time::timeout(Duration::from_secs(180), async {
            for case in ["a", "c"] {
                let dir = case_dir(case);
                let reference = Reference::open(&dir);
                let cases = cases_json(&dir);
                let image_token = cases["image_token_id"].as_u64().unwrap() as u32;
                let prompts = cases["prompts"].as_array().unwrap();
                let block_size = 4;
                let config = |kv_cache_bytes| {
                    let mut cfg = EngineConfig::new(dir.clone());
                    cfg.kv_cache_bytes = kv_cache_bytes;
                    cfg.block_size = block_size;
                    cfg.max_num_seqs = 6;
                    cfg.max_step_tokens = 16;
                    cfg.exact_activations = true;
                    cfg.enable_prefix_cache = false;
                    cfg
                };
                // The bytes of a block, from what a pool of 8 MiB holds.
                let probe = Engine::spawn(config(8 << 20)).await.unwrap();
                let block_bytes = (8 << 20) / probe.status().await.unwrap().num_total_blocks;
                probe.shutdown(true).await;
                // Room for the longest sequence and a block: six at once cannot all fit.
                let longest = prompts
                    .iter()
                    .map(|p| p["ids"].as_array().unwrap().len())
                    .max()
                    .unwrap();
                let want: Vec<Vec<u32>> = (0..prompts.len())
                    .map(|p| reference.ints(&format!("greedy_{p}")))
                    .collect();
                let blocks = (longest + want[0].len()).div_ceil(block_size) + 1;
                let engine = Engine::spawn(config(blocks * block_bytes)).await.unwrap();
                let mut requests = Vec::new();
                for _ in 0..3 {
                    for p in prompts {
                        requests.push(request(&dir, p, image_token, want[0].len()));
                    }
                }
                let out = common::engine::ok_outputs(&engine, requests).await;
                for (i, o) in out.iter().enumerate() {
                    let p = i % prompts.len();
                    assert_eq!(
                        o.token_ids, want[p],
                        "case {case}, request {i} (prompt {p})"
                    );
                }
                let status = engine.status().await.unwrap();
                assert!(
                    status.num_preemptions > 0,
                    "case {case}: nothing was preempted: {status:?}"
                );
                assert_eq!(
                    status.num_free_blocks, status.num_total_blocks,
                    "{status:?}"
                );
                engine.shutdown(true).await;
            }
        })
        .await
        .expect("the engine answered within 180 s");
    });
}

/// Two tensor-parallel ranks share the engine's encoder: every image is encoded once, not
/// once a rank, and the tokens are transformers'.
#[test]
fn tensor_parallel_ranks_share_one_encoding_of_each_image() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        tokio::time::timeout(Duration::from_secs(120), async {
            let dir = case_dir("c");
            let reference = Reference::open(&dir);
            let cases = cases_json(&dir);
            let image_token = cases["image_token_id"].as_u64().unwrap() as u32;
            let prompts = cases["prompts"].as_array().unwrap();
            let mut cfg = EngineConfig::new(dir.clone());
            cfg.kv_cache_bytes = 8 << 20;
            cfg.block_size = 4;
            cfg.exact_activations = true;
            cfg.tensor_parallel_size = 2;
            let engine = Engine::spawn(cfg).await.unwrap();
            let requests = prompts
                .iter()
                .map(|p| request(&dir, p, image_token, 8))
                .collect();
            let out = common::engine::ok_outputs(&engine, requests).await;
            for (p, o) in out.iter().enumerate() {
                let want = reference.ints(&format!("greedy_{p}"));
                assert_eq!(o.token_ids, want, "prompt {p}");
            }
            let distinct: std::collections::BTreeSet<u64> = prompts
                .iter()
                .flat_map(|p| p["images"].as_array().unwrap().iter())
                .map(|i| i.as_u64().unwrap())
                .collect();
            let status = engine.status().await.unwrap();
            assert_eq!(status.tensor_parallel_size, 2, "{status:?}");
            assert_eq!(
                status.num_encoded_images,
                distinct.len() as u64,
                "{status:?}"
            );
            engine.shutdown(true).await;
        })
        .await
        .expect("the engine answered within 120 s");
    });
}
