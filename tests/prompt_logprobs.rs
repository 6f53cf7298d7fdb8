//! Prompt logprobs (`EngineRequest::prompt_logprobs`) against transformers: the goldens'
//! prompts followed by transformers' own greedy continuation, scored by the engine in
//! several chunks, give transformers' last-position logprob and, at every greedy
//! position, its argmax and top-2 margin.

mod common;

use common::engine::tiny_config;
use troupe::engine::{
    Engine, EngineRequest, FinishReason, RequestOutput, SpecAcceptance, SpecConfig, SpecMethod,
    SpecVerify,
};
use troupe::sampling::SamplingParams;

/// Logprob and margin agreement with transformers: on the CPU f32 both sides, other
/// summation orders; on a GPU the engine holds the weights in bf16 (8 significant bits),
/// which moves tiny-llama's logprobs by up to ~0.016 against transformers' f32 (the same
/// on builds before and after the backend split, measured on an H100).
fn tolerance() -> f32 {
    match common::engine::test_device() {
        troupe::engine::Device::Cpu => 2e-3,
        _ => 5e-2,
    }
}

fn scored(prompt: Vec<u32>, num_top: usize) -> EngineRequest {
    let params = SamplingParams {
        temperature: 0.0,
        ..Default::default()
    };
    let mut r = EngineRequest::new(prompt, 1, params);
    r.prompt_logprobs = Some(num_top);
    r
}

fn log_softmax_at(logits: &[f32], id: u32) -> f32 {
    let lp = common::log_probs(logits);
    lp[id as usize] as f32
}

async fn run(model: &str, max_step_tokens: usize, spec: bool) {
    let reference = common::read_json(&format!(
        "{}/reference.json",
        model.trim_end_matches(".gguf")
    ));
    let cases = reference["cases"].as_array().unwrap();
    let mut cfg = tiny_config(model);
    // Prompts of 20-odd tokens span several chunks.
    cfg.max_step_tokens = max_step_tokens;
    // Speculation on: scored prompts beside the drafter, which proposes only once a
    // sequence is past its prompt.
    cfg.speculative = spec.then_some(SpecConfig {
        method: SpecMethod::Ngram,
        num_speculative_tokens: 3,
        verify: SpecVerify::Fixed,
        acceptance: SpecAcceptance::Coupled,
    });
    let engine = Engine::spawn(cfg).await.unwrap();
    let prompts: Vec<Vec<u32>> = cases
        .iter()
        .map(|c| {
            let mut p = common::ids(&c["prompt_ids"]);
            p.extend(common::ids(&c["greedy"]));
            p
        })
        .collect();
    // The same prompts unscored first: their blocks are cached, and a scored prompt must
    // not take them (a hit's positions would have no logits).
    let plain: Vec<EngineRequest> = prompts
        .iter()
        .map(|p| {
            let mut r = scored(p.clone(), 0);
            r.prompt_logprobs = None;
            r
        })
        .collect();
    let mut plain_tokens = Vec::new();
    for r in engine.generate_batch(plain).await {
        let o = r.expect("accepted");
        assert!(o.prompt_logprobs.is_none(), "unasked-for prompt logprobs");
        plain_tokens.push(o.token_ids);
    }
    let requests: Vec<EngineRequest> = prompts.iter().map(|p| scored(p.clone(), 2)).collect();
    let outs: Vec<RequestOutput> = engine
        .generate_batch(requests)
        .await
        .into_iter()
        .map(|r| r.expect("accepted"))
        .collect();
    for (i, (case, out)) in cases.iter().zip(&outs).enumerate() {
        let name = format!("{model} (chunks of {max_step_tokens}, spec {spec}) case {i}");
        assert!(out.error.is_none(), "{name}: {:?}", out.error);
        assert_eq!(out.finish_reason, Some(FinishReason::Length), "{name}");
        // The token drawn after a scored prompt is the one drawn after it unscored.
        assert_eq!(
            out.token_ids, plain_tokens[i],
            "{name}: the generated token"
        );
        let scores = out.prompt_logprobs.as_ref().expect("prompt logprobs");
        assert_eq!(
            scores.len(),
            prompts[i].len(),
            "{name}: one per prompt token"
        );
        assert!(
            scores[0].is_none(),
            "{name}: nothing precedes the first token"
        );
        let num_prompt = case["prompt_ids"].as_array().unwrap().len();
        let greedy = common::ids(&case["greedy"]);
        let margins = common::floats(&case["greedy_margins"]);
        for (p, s) in scores.iter().enumerate().skip(1) {
            let s = s
                .as_ref()
                .unwrap_or_else(|| panic!("{name}: position {p} unscored"));
            assert_eq!(s.top.len(), 2, "{name}: position {p}");
            assert!(
                s.logprob <= 0.0 && s.top[0].1 >= s.top[1].1,
                "{name}: {s:?}"
            );
        }
        let first = scores[num_prompt].as_ref().unwrap();
        let want = log_softmax_at(&common::floats(&case["last_logits"]), greedy[0]);
        assert!(
            (first.logprob - want).abs() < tolerance(),
            "{name}: logprob of the first greedy token {} vs transformers' {want}",
            first.logprob
        );
        for (j, (&token, &margin)) in greedy.iter().zip(&margins).enumerate() {
            let s = scores[num_prompt + j].as_ref().unwrap();
            let got_margin = s.top[0].1 - s.top[1].1;
            assert!(
                (got_margin - margin).abs() < tolerance(),
                "{name}: greedy step {j}: top-2 margin {got_margin} vs transformers' {margin}"
            );
            if margin > tolerance() {
                assert_eq!(s.top[0].0, token, "{name}: greedy step {j}: argmax");
                // What lm-evaluation-harness's `is_greedy` compares.
                assert_eq!(
                    s.logprob.to_bits(),
                    s.top[0].1.to_bits(),
                    "{name}: greedy step {j}: the argmax's logprob is its top entry's"
                );
            }
        }
    }
    engine.shutdown(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prompt_logprobs_match_transformers_in_chunks_and_whole() {
    for model in ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-llama.gguf"] {
        run(model, 7, false).await;
    }
    run("tiny-qwen3", 2048, false).await;
    run("tiny-llama", 7, true).await;
    run("tiny-qwen2", 2048, true).await;
}

/// Completions 1..n of a scored request start from completion 0's blocks; the scores come
/// once, on completion 0, and a request beside it is unaffected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prompt_logprobs_with_siblings_and_neighbours() {
    let engine = Engine::spawn(tiny_config("tiny-llama")).await.unwrap();
    let prompt: Vec<u32> = (0..40).map(|i| 3 + i * 7 % 380).collect();
    let mut with_n = scored(prompt.clone(), 0);
    with_n.n = 3;
    with_n.max_tokens = 4;
    let stream = engine.generate(with_n).await.unwrap();
    let neighbour = engine.generate(scored(prompt[..10].to_vec(), 1));
    let (choices, neighbour) = tokio::time::timeout(std::time::Duration::from_secs(60), async {
        let n = neighbour.await.unwrap().collect().await;
        (stream.collect_choices().await, n)
    })
    .await
    .expect("finished in time");
    assert_eq!(choices.len(), 3);
    let scores = choices[0]
        .prompt_logprobs
        .as_ref()
        .expect("on completion 0");
    assert_eq!(scores.len(), 40);
    assert!(
        scores[1..]
            .iter()
            .all(|s| s.as_ref().is_some_and(|s| s.top.is_empty()))
    );
    assert!(choices[1..].iter().all(|c| c.prompt_logprobs.is_none()));
    let n = neighbour.prompt_logprobs.expect("neighbour scored");
    // The neighbour's prompt is the first 10 tokens: the same scores.
    for p in 1..10 {
        let (a, b) = (n[p].as_ref().unwrap(), scores[p].as_ref().unwrap());
        assert!(
            (a.logprob - b.logprob).abs() < 1e-4,
            "position {p}: {a:?} vs {b:?}"
        );
    }
    engine.shutdown(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn too_many_top_ids_are_refused_by_name() {
    let engine = Engine::spawn(tiny_config("tiny-llama")).await.unwrap();
    let err = engine
        .generate(scored(vec![1, 2, 3], 21))
        .await
        .err()
        .expect("refused");
    assert!(err.to_string().contains("prompt_logprobs"), "{err}");
    engine.shutdown(true).await;
}

/// Scored prompts under a KV cache too small for all of them: sequences are preempted and
/// recomputed, and every one still reports each prompt position's score, equal to its
/// score run alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn preempted_scored_prompts_report_every_position() {
    let prompts: Vec<Vec<u32>> = (0..6u32)
        .map(|r| (0..50).map(|i| 3 + (r * 131 + i * 17) % 380).collect())
        .collect();
    let request = |p: &Vec<u32>| {
        let mut r = scored(p.clone(), 1);
        r.max_tokens = 24;
        r.ignore_eos = true;
        r
    };
    let solo = Engine::spawn(tiny_config("tiny-llama")).await.unwrap();
    let mut want = Vec::new();
    for p in &prompts {
        let o = solo.generate(request(p)).await.unwrap().collect().await;
        want.push(o.prompt_logprobs.expect("scored"));
    }
    solo.shutdown(true).await;
    let mut cfg = tiny_config("tiny-llama");
    cfg.kv_cache_bytes = 96 << 10;
    cfg.max_step_tokens = 16;
    let engine = Engine::spawn(cfg).await.unwrap();
    let outs = tokio::time::timeout(
        std::time::Duration::from_secs(120),
        engine.generate_batch(prompts.iter().map(request).collect()),
    )
    .await
    .expect("finished in time");
    let status = engine.status().await.unwrap();
    assert!(
        status.num_preemptions > 0,
        "the cache was not tight: {status:?}"
    );
    for (i, (o, want)) in outs.into_iter().zip(&want).enumerate() {
        let o = o.expect("accepted");
        assert!(o.error.is_none(), "{i}: {:?}", o.error);
        let got = o.prompt_logprobs.expect("every position scored");
        assert_eq!(got.len(), want.len());
        for (p, (g, w)) in got.iter().zip(want).enumerate().skip(1) {
            let (g, w) = (g.as_ref().unwrap(), w.as_ref().unwrap());
            assert!(
                (g.logprob - w.logprob).abs() < 1e-4,
                "{i} position {p}: {g:?} vs {w:?}"
            );
        }
    }
    engine.shutdown(true).await;
}
