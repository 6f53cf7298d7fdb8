//! End-to-end numerics against transformers: the tiny random Llama / Qwen2 / Qwen3
//! checkpoints (HF safetensors) and SmolLM2-135M-Instruct (GGUF Q4_1).

mod common;

use common::generate::{FinishReason, GenerateRequest, Generator};
use troupe::kernels::KvDtype;
use troupe::kernels::cpu::CpuBackend;
use troupe::model::chat_template::ChatMessage;
use troupe::sampling::SamplingParams;

/// Against transformers, with f32 activations (`--exact-activations`).
const LOGIT_TOLERANCE: f32 = 1e-3;

/// The dequantized model's arithmetic: f32 activations against the quantized weights.
fn exact() -> CpuBackend {
    CpuBackend {
        exact_activations: true,
        ..Default::default()
    }
}

fn greedy(prompt_ids: Vec<u32>, max_tokens: usize) -> GenerateRequest {
    GenerateRequest {
        prompt_ids,
        max_tokens,
        params: SamplingParams::default(),
        ignore_eos: false,
    }
}

/// `model` (a directory or GGUF under tests/goldens) against `reference` (its
/// transformers outputs), in a pool of `block_size`-token blocks.
fn check_tiny(model: &str, reference: &str, block_size: usize) {
    check_tiny_on(exact, model, reference, block_size);
}

/// `check_tiny` on the backends `backend` makes.
fn check_tiny_on(backend: fn() -> CpuBackend, model: &str, reference: &str, block_size: usize) {
    let name = model;
    let reference = common::read_json(reference);
    let mut loaded = common::load_on(&common::goldens().join(model), &backend());
    // The reference generated past EOS; so do we.
    loaded.text.stop_ids.clear();
    let mut generator = Generator::new(backend(), loaded, block_size);
    let cases = reference["cases"].as_array().unwrap();
    let mut requests = Vec::new();
    for (i, case) in cases.iter().enumerate() {
        let prompt = common::ids(&case["prompt_ids"]);
        let want_logits = common::floats(&case["last_logits"]);
        let got_logits = last_logits(&mut generator, &prompt, block_size);
        let err = common::relative_error(&got_logits, &want_logits);
        assert!(
            err < LOGIT_TOLERANCE,
            "{name} case {i}: logits relative error {err}"
        );
        requests.push(greedy(prompt, 16));
    }
    // All cases in one batch, and each alone: both equal the reference.
    let batched = generator.generate(&requests, |_| {}).unwrap();
    for (i, case) in cases.iter().enumerate() {
        let want = common::ids(&case["greedy"]);
        assert_eq!(batched[i].token_ids, want, "{name} case {i} (batched)");
        let alone = generator.generate(&requests[i..i + 1], |_| {}).unwrap();
        assert_eq!(alone[0].token_ids, want, "{name} case {i} (alone)");
    }
    let tok = generator
        .model
        .text
        .tokenizer
        .as_ref()
        .expect("tiny models ship a tokenizer.json");
    for case in reference["text_cases"].as_array().into_iter().flatten() {
        let text = case["text"].as_str().unwrap();
        assert_eq!(
            tok.encode(text).unwrap(),
            common::ids(&case["ids"]),
            "{name}: {text:?}"
        );
    }
    let template = generator
        .model
        .text
        .chat_template
        .as_ref()
        .expect("the checkpoint has a chat template");
    for case in reference["chat_cases"].as_array().into_iter().flatten() {
        let messages: Vec<ChatMessage> = case["messages"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| ChatMessage::new(m["role"].as_str().unwrap(), m["content"].as_str().unwrap()))
            .collect();
        let rendered = template.render(&messages, true).unwrap();
        assert_eq!(
            rendered,
            case["rendered"].as_str().unwrap(),
            "{name}: chat template"
        );
        assert_eq!(
            tok.encode(&rendered).unwrap(),
            common::ids(&case["ids"]),
            "{name}: chat ids"
        );
    }
}

/// Logits of the last prompt position, through a prefill split into two chunks so the
/// chunked path (cached tokens + new tokens) is what gets compared.
fn last_logits(
    generator: &mut Generator<CpuBackend>,
    prompt: &[u32],
    block_size: usize,
) -> Vec<f32> {
    use troupe::kernels::Backend;
    use troupe::model::llama::SeqStep;
    let model = &mut generator.model.model;
    let num_blocks = prompt.len().div_ceil(block_size);
    let mut cache = generator
        .backend
        .alloc_kv_cache(model.kv_cache_shape(num_blocks + 3, block_size));
    // Blocks in reverse order: the table, not the pool order, must decide where tokens live.
    let table: Vec<u32> = (0..num_blocks as u32).rev().map(|b| b + 3).collect();
    let split = prompt.len() / 2;
    let mut logits = Vec::new();
    for (start, chunk) in [(0, &prompt[..split]), (split, &prompt[split..])] {
        if chunk.is_empty() {
            continue;
        }
        let step = SeqStep {
            token_ids: chunk,
            num_cached_tokens: start,
            block_table: &table,
            num_logit_rows: 1,
            state: None,
        };
        logits = model.forward(&generator.backend, &mut cache, block_size, &[step]);
    }
    logits
}

/// The last `num_logit_rows` logit rows of `prompt` run as one chunk in a fresh cache.
fn trailing_logits(
    generator: &mut Generator<CpuBackend>,
    prompt: &[u32],
    num_logit_rows: usize,
) -> Vec<f32> {
    use troupe::kernels::Backend;
    use troupe::model::llama::SeqStep;
    let block_size = 16;
    let model = &mut generator.model.model;
    let num_blocks = prompt.len().div_ceil(block_size);
    let mut cache = generator
        .backend
        .alloc_kv_cache(model.kv_cache_shape(num_blocks, block_size));
    let table: Vec<u32> = (0..num_blocks as u32).collect();
    let step = SeqStep {
        token_ids: prompt,
        num_cached_tokens: 0,
        block_table: &table,
        num_logit_rows,
        state: None,
    };
    model.forward(&generator.backend, &mut cache, block_size, &[step])
}

/// A chunk's trailing logit rows (what a speculative verify row asks for) are each
/// prefix's own last-token logits — bitwise, in the batch-invariant mode — and the last is
/// transformers'.
#[test]
fn trailing_logit_rows_equal_each_prefixs_last_logits() {
    let reference = common::read_json("tiny-qwen3/reference.json");
    let loaded = common::load(&common::goldens().join("tiny-qwen3"));
    let backend = CpuBackend {
        batch_invariant: true,
        ..Default::default()
    };
    let mut generator = Generator::new(backend, loaded, 16);
    let vocab = generator.model.model.cfg.vocab_size;
    for (i, case) in reference["cases"].as_array().unwrap().iter().enumerate() {
        let prompt = common::ids(&case["prompt_ids"]);
        let k = prompt.len().min(5);
        let rows = trailing_logits(&mut generator, &prompt, k);
        assert_eq!(rows.len(), k * vocab);
        for j in 0..k {
            let prefix = &prompt[..prompt.len() - (k - 1 - j)];
            let alone = trailing_logits(&mut generator, prefix, 1);
            let row = &rows[j * vocab..(j + 1) * vocab];
            assert!(
                row.iter()
                    .zip(&alone)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "case {i}: row {j} of {k} differs from its prefix run alone"
            );
        }
        let err = common::relative_error(
            &rows[(k - 1) * vocab..],
            &common::floats(&case["last_logits"]),
        );
        assert!(err < LOGIT_TOLERANCE, "case {i}: {err}");
    }
}

#[test]
fn tiny_llama_with_llama3_rope_scaling_matches_transformers() {
    check_tiny("tiny-llama", "tiny-llama/reference.json", 16);
}

#[test]
fn tiny_qwen2_sharded_with_qkv_bias_matches_transformers() {
    check_tiny("tiny-qwen2", "tiny-qwen2/reference.json", 8);
}

#[test]
fn tiny_qwen3_with_qk_norm_matches_transformers() {
    check_tiny("tiny-qwen3", "tiny-qwen3/reference.json", 32);
}

/// The same weights converted as llama.cpp converts them: permuted q/k, `rope_freqs`,
/// and a gpt2 tokenizer with the `llama-bpe` split regex, from GGUF metadata.
#[test]
fn tiny_llama_gguf_matches_transformers() {
    check_tiny("tiny-llama.gguf", "tiny-llama/reference.json", 16);
}

/// Qwen2 from GGUF: tied output, q/k/v biases, the `qwen2` split regex.
#[test]
fn tiny_qwen2_gguf_matches_transformers() {
    check_tiny("tiny-qwen2.gguf", "tiny-qwen2/reference.json", 16);
}

/// Q8_0 matrices, kept quantized by the CPU backend, against transformers running the
/// dequantized weights.
#[test]
fn tiny_llama_q8_0_gguf_matches_transformers() {
    check_tiny("tiny-llama-q8.gguf", "tiny-llama-q8.reference.json", 16);
}

/// The legacy block formats gguf-py quantizes (scripts/make_gguf_goldens.py), each kept
/// packed: with f32 activations the logits are transformers' on the dequantized weights
/// (1e-3, greedy tokens equal); with 8-bit activations within `EIGHT_BIT_TOLERANCE`.
#[test]
fn tiny_llama_in_every_legacy_format_matches_transformers() {
    // Measured 1.5e-2 to 2.4e-2 (a random model: activations without structure).
    const EIGHT_BIT_TOLERANCE: f32 = 4e-2;
    for format in ["q8", "q4_0", "q4_1", "q5_0", "q5_1"] {
        let (model, reference) = (
            format!("tiny-llama-{format}.gguf"),
            format!("tiny-llama-{format}.reference.json"),
        );
        check_tiny(&model, &reference, 16);
        let cases = common::read_json(&reference);
        let loaded = common::load(&common::goldens().join(&model));
        let mut generator = Generator::new(CpuBackend::default(), loaded, 16);
        let mut worst = 0f32;
        for case in cases["cases"].as_array().unwrap() {
            let prompt = common::ids(&case["prompt_ids"]);
            let got = last_logits(&mut generator, &prompt, 16);
            let err = common::relative_error(&got, &common::floats(&case["last_logits"]));
            worst = worst.max(err);
        }
        eprintln!("{model}: 8-bit activations, logits relative error {worst:.2e}");
        assert!(
            worst > 0.0,
            "{model}: 8-bit path gave the exact logits: is it in use?"
        );
        assert!(
            worst < EIGHT_BIT_TOLERANCE,
            "{model}: 8-bit logits off by {worst}"
        );
    }
}

/// Every K-quant and IQ4 format in one file (scripts/make_kquant_goldens.py: ggml's own
/// quantizer, each layer tensor in another format, stacked q/k/v and gate/up mixing them):
/// kept packed, f32 activations give transformers' logits on gguf-py's dequantization;
/// 8-bit activations stay within the legacy formats' bound.
#[test]
fn k_quants_and_iq4_match_transformers_on_their_dequantization() {
    // Measured 3.2e-2.
    const EIGHT_BIT_TOLERANCE: f32 = 4e-2;
    let (model, reference) = (
        "tiny-llama-kquants.gguf",
        "tiny-llama-kquants.reference.json",
    );
    check_tiny(model, reference, 16);
    let cases = common::read_json(reference);
    let loaded = common::load(&common::goldens().join(model));
    let mut generator = Generator::new(CpuBackend::default(), loaded, 16);
    let mut worst = 0f32;
    for case in cases["cases"].as_array().unwrap() {
        let got = last_logits(&mut generator, &common::ids(&case["prompt_ids"]), 16);
        worst = worst.max(common::relative_error(
            &got,
            &common::floats(&case["last_logits"]),
        ));
    }
    eprintln!("{model}: 8-bit activations, logits relative error {worst:.2e}");
    assert!(
        worst > 0.0 && worst < EIGHT_BIT_TOLERANCE,
        "{model}: {worst}"
    );
}

/// FP8 checkpoints of generated shapes in both layouts (scripts/make_fp8_goldens.py):
/// HF `fp8` with `weight_scale_inv` blocks that need not divide the matrices, and
/// compressed-tensors with per-channel `weight_scale`; against transformers running the
/// dequantized weights.
#[test]
fn fp8_checkpoints_in_both_layouts_match_transformers() {
    for layout in ["block", "channel"] {
        let model = format!("fp8/tiny-fp8-{layout}");
        check_tiny(&model, &format!("{model}/reference.json"), 16);
    }
}

/// `--quantization fp8` on a dense checkpoint: the projections quantized per channel at
/// load give the logits transformers gives with torch's per-channel e4m3 of the same
/// weights.
#[test]
fn quantization_fp8_matches_torchs_per_channel_quantization() {
    fn fp8() -> CpuBackend {
        CpuBackend {
            quantization: Some(troupe::kernels::fp8::Quantization::Fp8),
            ..exact()
        }
    }
    check_tiny_on(
        fp8,
        "tiny-llama",
        "fp8/tiny-llama-quantized.reference.json",
        16,
    );
}

#[test]
fn smollm2_gguf_matches_transformers() {
    let golden = common::read_json("smollm2.json");
    let loaded = common::load_on(&common::smollm2_path(), &exact());
    let tok = loaded.text.tokenizer.as_ref().unwrap();
    let template = loaded.text.chat_template.as_ref().unwrap();
    let prompts = golden["prompts"].as_array().unwrap();
    let mut requests = Vec::new();
    for p in prompts {
        let text = p["text"].as_str().unwrap();
        let want_ids = common::ids(&p["prompt_ids"]);
        let got_ids = if p["chat"].as_bool().unwrap() {
            let rendered = template
                .render(&[ChatMessage::new("user", text)], true)
                .unwrap();
            assert_eq!(
                rendered,
                p["rendered"].as_str().unwrap(),
                "chat template of {text:?}"
            );
            tok.encode(&rendered).unwrap()
        } else {
            tok.encode_prompt(text).unwrap()
        };
        assert_eq!(got_ids, want_ids, "prompt ids of {text:?}");
        requests.push(greedy(want_ids, 32));
    }
    let mut generator = Generator::new(exact(), loaded, 16);
    // Logits: each prompt alone, last position, on the reference's top-20 ids.
    for (p, req) in prompts.iter().zip(&requests) {
        let logits = last_logits(&mut generator, &req.prompt_ids, 16);
        let top: Vec<(u32, f32)> = p["top20"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| (e[0].as_u64().unwrap() as u32, e[1].as_f64().unwrap() as f32))
            .collect();
        let got: Vec<f32> = top.iter().map(|&(id, _)| logits[id as usize]).collect();
        let want: Vec<f32> = top.iter().map(|&(_, v)| v).collect();
        let err = common::relative_error(&got, &want);
        assert!(
            err < LOGIT_TOLERANCE,
            "{}: top-20 logits relative error {err}",
            p["name"]
        );
        assert_eq!(
            troupe::sampling::argmax(&logits),
            top[0].0,
            "{}: argmax",
            p["name"]
        );
    }
    // Greedy: all prompts as one batch.
    let outputs = generator.generate(&requests, |_| {}).unwrap();
    let stop = golden["eos_id"].as_u64().unwrap() as u32;
    for (p, out) in prompts.iter().zip(&outputs) {
        let mut want = common::ids(&p["greedy"]);
        let stopped = want.last() == Some(&stop);
        if stopped {
            want.pop();
        }
        assert_eq!(out.token_ids, want, "{}: greedy tokens", p["name"]);
        let reason = if stopped {
            FinishReason::Stop
        } else {
            FinishReason::Length
        };
        assert_eq!(out.finish_reason, reason, "{}", p["name"]);
    }
}

/// The default path (8-bit activations, integer dots) against the dequantized model's
/// arithmetic on SmolLM2's golden prompts, each ending in a one-token decode step: the
/// log-probabilities of the reference's top-20 tokens move by at most `BOUND` (measured
/// 0.14; llama.cpp's logits on the same file spread by 0.26–0.76 against transformers').
#[test]
fn eight_bit_activations_stay_within_a_bounded_logprob_error_of_the_exact_path() {
    const BOUND: f64 = 0.25;
    let golden = common::read_json("smollm2.json");
    let path = common::smollm2_path();
    let mut exact_gen = Generator::new(exact(), common::load_on(&path, &exact()), 16);
    let mut fast_gen = Generator::new(CpuBackend::default(), common::load(&path), 16);
    let mut worst = 0f64;
    for p in golden["prompts"].as_array().unwrap() {
        let prompt = common::ids(&p["prompt_ids"]);
        let want = common::log_probs(&common::decode_logits(
            &mut exact_gen,
            &prompt,
            KvDtype::Auto,
        ));
        let got = common::log_probs(&common::decode_logits(
            &mut fast_gen,
            &prompt,
            KvDtype::Auto,
        ));
        for e in p["top20"].as_array().unwrap() {
            let id = e[0].as_u64().unwrap() as usize;
            worst = worst.max((got[id] - want[id]).abs());
        }
    }
    eprintln!("largest top-20 logprob change: {worst:.4}");
    assert!(
        worst > 0.0,
        "the two paths gave the same logits: is the fast path in use?"
    );
    assert!(
        worst < BOUND,
        "top-20 logprob changed by {worst} (bound {BOUND})"
    );
}

/// Transformers' greedy sequences of generated chat prompts fed back one token at a time
/// (the 8-bit decode path): troupe's argmax equals transformers' token at least as often
/// as llama.cpp's does on the same file (scripts/make_agreement_goldens.py). Teacher
/// forcing keeps one near-tie flip from deciding the count.
#[test]
fn eight_bit_greedy_agrees_with_transformers_at_least_as_well_as_llama_cpp() {
    let golden = common::read_json("smollm2_agreement.json");
    let mut generator = Generator::new(
        CpuBackend::default(),
        common::load(&common::smollm2_path()),
        16,
    );
    let (mut ours, mut llama_cpp, mut total) = (0, 0, 0);
    for p in golden["prompts"].as_array().unwrap() {
        let prompt = common::ids(&p["prompt_ids"]);
        let want = common::ids(&p["greedy"]);
        ours += common::forced_argmax_hits(&mut generator, &prompt, &want, KvDtype::Auto);
        let theirs = common::ids(&p["llama_cpp_forced_argmax"]);
        llama_cpp += theirs.iter().zip(&want).filter(|(a, b)| a == b).count();
        total += want.len();
    }
    eprintln!(
        "argmax equal to transformers' token: troupe {ours}, llama.cpp {llama_cpp} of {total}"
    );
    assert!(
        ours >= llama_cpp,
        "troupe {ours} < llama.cpp {llama_cpp} of {total}"
    );
}
