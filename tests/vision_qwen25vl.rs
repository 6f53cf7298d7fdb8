//! Qwen2.5-VL against transformers (issue 64), on the generated checkpoints of
//! `scripts/make_vision_goldens.py`: the processor's pixels (its Pillow backend bit for bit,
//! its torchvision backend within a few 8-bit levels), the vision encoder's rows, the logits
//! of prompts with one to three images at every position (whole, and in chunks that split
//! an image's tokens, two prompts in one step), and greedy tokens after them.

mod common;

use common::vision::{
    BLOCK, Reference, case_dir, cases_json, encoder, exact, greedy_of, load_model, media_for,
    patches_of, prompts, request,
};
use troupe::api::EngineRequest;
use troupe::kernels::Backend;
use troupe::model::llama::SeqStep;

const CASES: [&str; 3] = ["a", "b", "c"];
const LOGIT_TOLERANCE: f32 = 1e-3;

#[test]
fn pixels_equal_the_processors() {
    for case in CASES {
        let dir = case_dir(case);
        let reference = Reference::open(&dir);
        let cases = cases_json(&dir);
        for (i, image) in cases["images"].as_array().unwrap().iter().enumerate() {
            let got = patches_of(&dir, i);
            let grid: Vec<usize> = image["grid"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_u64().unwrap() as usize)
                .collect();
            assert_eq!(got.grid.to_vec(), grid, "case {case} image {i}: grid");
            let pil = reference.floats(&format!("pixel_values_pil_{i}"));
            assert_eq!(got.values.len(), pil.len(), "case {case} image {i}");
            let exact = got.values.iter().zip(&pil).filter(|(a, b)| a == b).count();
            assert_eq!(
                exact,
                pil.len(),
                "case {case} image {i}: {} of {} values differ from Pillow's",
                pil.len() - exact,
                pil.len()
            );
            // torchvision's uint8 resize rounds its own way: where it upscales several
            // times over, a value may land up to three 8-bit levels from Pillow's
            // (1 / (255 · std) ≤ 0.0151 a level); on average far less than one.
            let tv = reference.floats(&format!("pixel_values_tv_{i}"));
            let diffs: Vec<f32> = got
                .values
                .iter()
                .zip(&tv)
                .map(|(a, b)| (a - b).abs())
                .collect();
            let worst = diffs.iter().fold(0f32, |m, &d| m.max(d));
            let mean = diffs.iter().sum::<f32>() / diffs.len() as f32;
            assert!(
                worst < 3.0 * 0.0152 && mean < 0.004,
                "case {case} image {i}: torchvision off by {worst} at worst, {mean} on average"
            );
        }
    }
}

#[test]
fn encoder_rows_equal_transformers() {
    for case in CASES {
        let dir = case_dir(case);
        let reference = Reference::open(&dir);
        let enc = encoder(&dir);
        for i in 0..4 {
            let patches = patches_of(&dir, i);
            let got = enc.encode(&patches);
            let want = reference.floats(&format!("image_embeds_{i}"));
            assert_eq!(got.len(), patches.num_tokens() * enc.cfg.out_hidden_size);
            let err = common::relative_error(&got, &want);
            assert!(err < 1e-4, "case {case} image {i}: relative error {err}");
        }
    }
}

#[test]
fn a_batch_of_images_encodes_as_each_alone() {
    for case in CASES {
        let dir = case_dir(case);
        let reference = Reference::open(&dir);
        let enc = encoder(&dir);
        let patches: Vec<_> = (0..4).map(|i| patches_of(&dir, i)).collect();
        // Drawn subsets, in drawn orders, of the committed images.
        let mut rng = common::Rng(case.as_bytes()[0] as u64);
        for _ in 0..3 {
            let picked: Vec<usize> = (0..1 + rng.below(4)).map(|_| rng.below(4)).collect();
            let batch: Vec<(&[f32], [usize; 3])> = (picked.iter())
                .map(|&i| (&patches[i].values[..], patches[i].grid))
                .collect();
            for (&i, got) in picked.iter().zip(enc.encode_batch(&batch)) {
                let want = reference.floats(&format!("image_embeds_{i}"));
                let err = common::relative_error(&got, &want);
                assert!(
                    err < 1e-4,
                    "case {case} image {i} of {picked:?}: relative error {err}"
                );
            }
        }
    }
}

#[test]
fn logits_equal_transformers_whole_and_in_chunks() {
    let backend = exact();
    for case in CASES {
        let dir = case_dir(case);
        let reference = Reference::open(&dir);
        let enc = encoder(&dir);
        let mut model = load_model(&dir, &backend);
        let hidden = model.cfg.hidden_size;
        let vocab = model.cfg.vocab_size;
        let prompts = prompts(&dir, &enc);
        for (p, prompt) in prompts.iter().enumerate() {
            let want = reference.floats(&format!("logits_{p}"));
            let n = prompt.ids.len();
            let blocks = n.div_ceil(BLOCK);
            let table: Vec<u32> = (0..blocks as u32).rev().collect();
            // Whole.
            let mut cache = backend.alloc_kv_cache(model.kv_cache_shape(blocks, BLOCK));
            let step = SeqStep {
                token_ids: &prompt.ids,
                num_cached_tokens: 0,
                block_table: &table,
                num_logit_rows: n,
                state: None,
            };
            let media = [media_for(0, prompt, 0, n, hidden)];
            let got = model.forward_with_media(&backend, &mut cache, BLOCK, &[step], &media);
            let err = common::relative_error(&got, &want);
            assert!(
                err < LOGIT_TOLERANCE,
                "case {case} prompt {p}: relative error {err}"
            );
            // In three chunks, the cuts inside the first image.
            let first = prompt.spans[0];
            let cuts = [
                0,
                first.start + 1,
                first.start + first.num_tokens() / 2 + 1,
                n,
            ];
            let mut cache = backend.alloc_kv_cache(model.kv_cache_shape(blocks, BLOCK));
            for w in cuts.windows(2) {
                let (lo, hi) = (w[0], w[1]);
                let step = SeqStep {
                    token_ids: &prompt.ids[lo..hi],
                    num_cached_tokens: lo,
                    block_table: &table,
                    num_logit_rows: hi - lo,
                    state: None,
                };
                let media = [media_for(0, prompt, lo, hi, hidden)];
                let got = model.forward_with_media(&backend, &mut cache, BLOCK, &[step], &media);
                let err = common::relative_error(&got, &want[lo * vocab..hi * vocab]);
                assert!(
                    err < LOGIT_TOLERANCE,
                    "case {case} prompt {p}, chunk {lo}..{hi}: relative error {err}"
                );
            }
        }
        // Two prompts in one step, beside a text-only row.
        let text: Vec<u32> = (1..9).collect();
        let (a, b) = (&prompts[0], &prompts[2]);
        let blocks_a = a.ids.len().div_ceil(BLOCK);
        let blocks_b = b.ids.len().div_ceil(BLOCK);
        let total = blocks_a + blocks_b + 1;
        let mut cache = backend.alloc_kv_cache(model.kv_cache_shape(total, BLOCK));
        let ta: Vec<u32> = (0..blocks_a as u32).collect();
        let tb: Vec<u32> = (blocks_a as u32..(blocks_a + blocks_b) as u32).collect();
        let tt = vec![total as u32 - 1];
        let steps = [
            SeqStep {
                token_ids: &text,
                num_cached_tokens: 0,
                block_table: &tt,
                num_logit_rows: 1,
                state: None,
            },
            SeqStep {
                token_ids: &a.ids,
                num_cached_tokens: 0,
                block_table: &ta,
                num_logit_rows: 1,
                state: None,
            },
            SeqStep {
                token_ids: &b.ids,
                num_cached_tokens: 0,
                block_table: &tb,
                num_logit_rows: 1,
                state: None,
            },
        ];
        let media = [
            media_for(1, a, 0, a.ids.len(), hidden),
            media_for(2, b, 0, b.ids.len(), hidden),
        ];
        let got = model.forward_with_media(&backend, &mut cache, BLOCK, &steps, &media);
        for (row, (p, prompt)) in [(1, (0, a)), (2, (2, b))] {
            let want = reference.floats(&format!("logits_{p}"));
            let n = prompt.ids.len();
            let err = common::relative_error(
                &got[row * vocab..(row + 1) * vocab],
                &want[(n - 1) * vocab..n * vocab],
            );
            assert!(
                err < LOGIT_TOLERANCE,
                "case {case} batched prompt {p}: {err}"
            );
        }
    }
}

#[test]
fn greedy_tokens_equal_transformers() {
    let backend = exact();
    for case in CASES {
        let dir = case_dir(case);
        let reference = Reference::open(&dir);
        let enc = encoder(&dir);
        let mut model = load_model(&dir, &backend);
        for (p, prompt) in prompts(&dir, &enc).iter().enumerate() {
            let want = reference.ints(&format!("greedy_{p}"));
            let got = greedy_of(&mut model, &backend, prompt, want.len());
            assert_eq!(got, want, "case {case} prompt {p}");
        }
    }
}

/// What a request's images must be, each refusal naming the image and the problem.
#[test]
fn bad_images_are_refused_by_name() {
    use troupe::api::{ImageLimits, RequestLimits};
    let dir = case_dir("a");
    let text = troupe::model::load_text(&dir).unwrap();
    let cases = cases_json(&dir);
    let image_token = cases["image_token_id"].as_u64().unwrap() as u32;
    let limits = RequestLimits {
        vocab_size: text.config.vocab_size,
        max_context_tokens: text.config.max_context_tokens,
        scores_prompts: true,
        images: ImageLimits::of(&text),
    };
    let good = request(&dir, &cases["prompts"][1], image_token, 4);
    good.validate(limits).unwrap();
    let refused = |r: &EngineRequest, limits: RequestLimits, says: &str| {
        let err = r.validate(limits).unwrap_err().to_string();
        assert!(err.starts_with("images: ") && err.contains(says), "{err}");
    };
    let no_vision = RequestLimits {
        images: None,
        ..limits
    };
    refused(&good, no_vision, "this model takes no images");
    let mut r = good.clone();
    r.images[0].first_token -= 1;
    refused(&r, limits, "is not the image placeholder");
    let mut r = good.clone();
    r.images.swap(0, 1);
    refused(&r, limits, "overlap another image");
    let mut r = good.clone();
    r.images[1].pixels = vec![0.0; 7].into();
    refused(&r, limits, "image 1: 7 pixel values");
    let mut r = good.clone();
    r.prompt_logprobs = Some(1);
    refused(&r, limits, "prompt_logprobs");
}
