//! Per-request sampling through the engine: seeded output independent of the batch
//! (the "needle" test), repeatability under load, stop strings across token boundaries,
//! and streamed text that never splits a character.

mod common;

use common::engine::tiny_config;
use std::time::Duration;
use troupe::engine::{
    Engine, EngineHandle, EngineRequest, FinishReason, IncrementalDecoder, RequestOutput,
    TextStream,
};

use troupe::sampling::{SamplingParams, splitmix64};

/// The smallest vocabulary among the models these tests run (tiny-dsv4-a's).
const VOCAB: u32 = 256;

fn sampled_request(seed: u64, salt: u64) -> EngineRequest {
    let h = |k: u64| splitmix64(seed ^ splitmix64(salt * 7919 + k));
    let len = 3 + (h(0) % 60) as usize;
    let prompt = (0..len)
        .map(|j| 3 + (h(10 + j as u64) % (VOCAB as u64 - 3)) as u32)
        .collect();
    let params = SamplingParams {
        temperature: 0.8,
        num_top_logprobs: 5,
        ..Default::default()
    };
    let mut r = EngineRequest::new(prompt, 6 + (h(1) % 20) as usize, params);
    r.seed = Some(h(2));
    r.ignore_eos = true;
    r
}

/// Tokens, token logprob bits, top-logprob (id, bits) pairs.
type Fingerprint = (Vec<u32>, Vec<u32>, Vec<Vec<(u32, u32)>>);

/// What must be bitwise equal between runs of the same request.
fn fingerprint(o: &RequestOutput) -> Fingerprint {
    (
        o.token_ids.clone(),
        o.token_logprobs.iter().map(|l| l.to_bits()).collect(),
        o.top_logprobs
            .iter()
            .map(|t| t.iter().map(|(id, l)| (*id, l.to_bits())).collect())
            .collect(),
    )
}

/// `needle` at position `at` among `others`; returns the needle's output.
async fn run_among(
    engine: &EngineHandle,
    needle: &EngineRequest,
    others: Vec<EngineRequest>,
    at: usize,
) -> RequestOutput {
    let mut batch = others;
    batch.insert(at, needle.clone());
    let mut outs = engine.generate_batch(batch).await;
    let out = outs.remove(at).unwrap();
    assert!(out.error.is_none(), "{:?}", out.error);
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn needle_is_bitwise_identical_in_any_batch_with_batch_invariant_kernels() {
    // DeepSeek-V4 too (its host pass): without the mode this needle differs at a batch of 5.
    for model in ["tiny-llama-q8.gguf", "tiny-qwen3", "tiny-dsv4-a"] {
        let needle = sampled_request(1, 0);
        let mut cfg = tiny_config(model);
        cfg.batch_invariant = true;
        let engine = Engine::spawn(cfg.clone()).await.unwrap();
        let alone = run_among(&engine, &needle, Vec::new(), 0).await;
        for (trial, size) in [2usize, 5, 17, 33, 64].into_iter().enumerate() {
            let others: Vec<_> = (0..size - 1)
                .map(|i| sampled_request(100 + trial as u64, i as u64 + 1))
                .collect();
            let at = (splitmix64(trial as u64) % size as u64) as usize;
            let got = run_among(&engine, &needle, others, at).await;
            assert_eq!(
                fingerprint(&got),
                fingerprint(&alone),
                "{model}: batch of {size}, needle at {at}"
            );
        }
        engine.shutdown(true).await;
        // Small steps: the prompt is prefilled in many chunks instead of one.
        cfg.max_step_tokens = 7;
        let engine = Engine::spawn(cfg).await.unwrap();
        let chunked = run_among(&engine, &needle, vec![sampled_request(9, 9)], 1).await;
        assert_eq!(
            fingerprint(&chunked),
            fingerprint(&alone),
            "{model}: chunked prefill"
        );
        engine.shutdown(true).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn greedy_needle_keeps_its_tokens_in_any_batch_without_the_mode() {
    let mut needle = sampled_request(2, 0);
    needle.params.temperature = 0.0;
    let engine = Engine::spawn(tiny_config("tiny-llama-q8.gguf"))
        .await
        .unwrap();
    let alone = run_among(&engine, &needle, Vec::new(), 0).await;
    for (trial, size) in [3usize, 16, 64].into_iter().enumerate() {
        let others: Vec<_> = (0..size - 1)
            .map(|i| sampled_request(200 + trial as u64, i as u64 + 1))
            .collect();
        let got = run_among(&engine, &needle, others, size / 2).await;
        assert_eq!(got.token_ids, alone.token_ids, "batch of {size}");
    }
    engine.shutdown(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_runs_under_random_load_give_one_unique_output() {
    let mut cfg = tiny_config("tiny-llama-q8.gguf");
    cfg.batch_invariant = true;
    let engine = Engine::spawn(cfg).await.unwrap();
    let request = sampled_request(3, 0);
    let mut outputs = std::collections::HashSet::new();
    for run in 0..50u64 {
        let load: Vec<_> = (0..splitmix64(run) % 12)
            .map(|i| sampled_request(300 + run, i + 1))
            .collect();
        let handle = engine.clone();
        let background = tokio::spawn(async move { handle.generate_batch(load).await });
        let out = engine
            .generate(request.clone())
            .await
            .unwrap()
            .collect()
            .await;
        background.await.unwrap();
        outputs.insert(fingerprint(&out));
    }
    assert_eq!(outputs.len(), 1);
    engine.shutdown(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unseeded_request_reports_the_seed_that_reproduces_it() {
    let engine = Engine::spawn(tiny_config("tiny-llama")).await.unwrap();
    let mut request = sampled_request(4, 0);
    request.seed = None;
    let first = engine
        .generate(request.clone())
        .await
        .unwrap()
        .collect()
        .await;
    let seed = first.seed.expect("the final output reports the seed");
    request.seed = Some(seed);
    let again = engine.generate(request).await.unwrap().collect().await;
    assert_eq!(first.token_ids, again.token_ids);
    engine.shutdown(true).await;
}

/// A greedy request on "the quick brown fox" that ignores EOS, and its free run (no stop
/// string): what the stop-string tests cut.
async fn greedy_run(engine: &EngineHandle, max_tokens: usize) -> (EngineRequest, RequestOutput) {
    let tok = engine.text().tokenizer.clone().unwrap();
    let mut request = EngineRequest::new(
        tok.encode("the quick brown fox").unwrap(),
        max_tokens,
        SamplingParams::default(),
    );
    request.ignore_eos = true;
    let free = engine
        .generate(request.clone())
        .await
        .unwrap()
        .collect()
        .await;
    (request, free)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_strings_match_across_token_boundaries_and_are_cut_off() {
    let engine = Engine::spawn(tiny_config("tiny-llama")).await.unwrap();
    let tok = engine.text().tokenizer.clone().unwrap();
    let (mut request, free) = greedy_run(&engine, 40).await;
    // A stop string that starts inside one token and ends inside a later one.
    let pieces: Vec<String> = free
        .token_ids
        .iter()
        .map(|&t| tok.decode(&[t], true).unwrap())
        .collect();
    let starts: Vec<usize> = pieces
        .iter()
        .scan(0, |acc, p| {
            let s = *acc;
            *acc += p.len();
            Some(s)
        })
        .collect();
    let i = (2..pieces.len() - 2)
        .find(|&i| pieces[i].len() >= 2 && pieces[i + 1].len() >= 2)
        .expect("multi-byte tokens");
    let from = starts[i] + 1;
    let to = starts[i + 1] + pieces[i + 1].len() - 1;
    let stop = free.text[from..to].to_string();
    assert!(stop.len() >= 2);
    request.stop = vec![stop.clone()];
    let stopped = engine.generate(request).await.unwrap().collect().await;
    assert_eq!(stopped.finish_reason, Some(FinishReason::Stop));
    let cut = free.text.find(&stop).unwrap();
    assert_eq!(stopped.text, free.text[..cut], "stop string {stop:?}");
    engine.shutdown(true).await;
}

/// The scheduler's text path, token by token: incremental decoding, then the stream.
fn stream_tokens(tok: &troupe::model::tokenizer::Tokenizer, ids: &[u32]) -> String {
    let mut decoder = IncrementalDecoder::default();
    let mut stream = TextStream::new(Vec::new());
    let mut out = String::new();
    for n in 1..=ids.len() {
        decoder.update(tok, &ids[..n], n == ids.len());
        let (piece, _) = stream.next(&decoder.text, n == ids.len());
        assert!(
            !piece.contains('\u{FFFD}'),
            "a partial character escaped: {piece:?}"
        );
        out.push_str(&piece);
    }
    out
}

#[test]
fn streamed_text_never_splits_a_character_with_the_real_tokenizer() {
    let gguf = troupe::model::gguf::GgufFile::open(&common::smollm2_path()).unwrap();
    let tok = troupe::model::tokenizer::Tokenizer::from_gguf(&gguf).unwrap();
    let text = "Crabs 🦀 and café, naïve 日本語 — done ✅";
    let ids = tok.encode(text).unwrap();
    let num_split = (1..=ids.len())
        .filter(|&n| tok.decode(&ids[..n], true).unwrap().ends_with('\u{FFFD}'))
        .count();
    assert!(
        num_split > 0,
        "the text should split characters across tokens"
    );
    assert_eq!(stream_tokens(&tok, &ids), text);
}

#[test]
fn incremental_decoding_equals_a_full_decode_for_sentencepiece_too() {
    // SentencePiece strips the leading space of a sequence's first piece: decoding a
    // window mid-sequence must not strip spaces between words.
    let gguf =
        troupe::model::gguf::GgufFile::open(&common::goldens().join("spm_tiny.gguf")).unwrap();
    let tok = troupe::model::tokenizer::Tokenizer::from_gguf(&gguf).unwrap();
    for text in [
        "Hello world, this is a test",
        "  two leading spaces and é",
        "line one\nline two",
    ] {
        let ids = tok.encode_plain(text).unwrap();
        assert_eq!(
            stream_tokens(&tok, &ids),
            tok.decode(&ids, true).unwrap(),
            "{text:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn n_completions_share_the_prompt_blocks_and_free_them_once() {
    let mut cfg = tiny_config("tiny-llama");
    cfg.batch_invariant = true;
    let engine = Engine::spawn(cfg).await.unwrap();
    let mut request = sampled_request(5, 0);
    request.prompt_ids = (0..70).map(|i| 3 + (i * 11) % 380).collect(); // 4 full 16-token blocks
    request.max_tokens = 12;
    request.n = 4;
    let before = engine.status().await.unwrap();
    let choices = engine
        .generate(request.clone())
        .await
        .unwrap()
        .collect_choices()
        .await;
    let after = engine.status().await.unwrap();
    assert_eq!(choices.len(), 4);
    assert!(
        choices
            .iter()
            .all(|c| c.error.is_none() && c.token_ids.len() == 12)
    );
    let distinct: std::collections::HashSet<_> =
        choices.iter().map(|c| c.token_ids.clone()).collect();
    assert!(
        distinct.len() > 1,
        "completions with their own seeds should differ"
    );
    // Completions 1..4 started from completion 0's four cached prompt blocks.
    assert_eq!(
        after.num_prefix_hit_blocks - before.num_prefix_hit_blocks,
        3 * 4,
        "{after:?}"
    );
    // Each completion is what a single request with its reported seed gives.
    for c in &choices {
        let mut alone = request.clone();
        alone.n = 1;
        alone.seed = c.seed;
        let single = engine.generate(alone).await.unwrap().collect().await;
        assert_eq!(single.token_ids, c.token_ids, "completion {}", c.index);
    }
    let status = engine.status().await.unwrap();
    assert_eq!(
        status.num_free_blocks, status.num_total_blocks,
        "shared blocks freed exactly once: {status:?}"
    );
    let refused = engine.generate(EngineRequest { n: 0, ..request }).await;
    assert!(refused.err().unwrap().to_string().contains("n must be in"));
    engine.shutdown(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_token_ids_end_a_request_and_min_tokens_bans_them_until_then() {
    let engine = Engine::spawn(tiny_config("tiny-llama")).await.unwrap();
    let mut request = EngineRequest::new((5..25).collect(), 20, SamplingParams::default());
    request.ignore_eos = true;
    let free = engine
        .generate(request.clone())
        .await
        .unwrap()
        .collect()
        .await;
    let stop = free.token_ids[3];
    let first = free.token_ids.iter().position(|&t| t == stop).unwrap();
    request.stop_token_ids = vec![stop];
    let stopped = engine
        .generate(request.clone())
        .await
        .unwrap()
        .collect()
        .await;
    assert_eq!(stopped.finish_reason, Some(FinishReason::Stop));
    assert_eq!(
        stopped.token_ids,
        free.token_ids[..first],
        "the stop token is not emitted"
    );
    request.min_tokens = first + 3;
    let held = engine.generate(request).await.unwrap().collect().await;
    assert!(held.token_ids.len() >= first + 3, "{:?}", held.token_ids);
    assert!(
        !held.token_ids[..first + 3].contains(&stop),
        "banned before min_tokens: {:?}",
        held.token_ids
    );
    engine.shutdown(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_string_ends_every_completion_and_its_sequence() {
    let engine = Engine::spawn(tiny_config("tiny-llama")).await.unwrap();
    let tok = engine.text().tokenizer.clone().unwrap();
    let (mut request, free) = greedy_run(&engine, 60).await;
    // A stop string from the middle of the greedy text: every (greedy) completion meets it.
    let chars: Vec<(usize, char)> = free.text.char_indices().collect();
    let (from, to) = (chars[chars.len() / 3].0, chars[chars.len() / 3 + 3].0);
    let stop = free.text[from..to].to_string();
    request.stop = vec![stop.clone()];
    request.n = 3;
    // Room to run on far past the stop (a third of the 60-token free run): a sequence the
    // scheduler never stops computes ~400 tokens, one it stops only what was in flight —
    // even a test thread starved under load leaves far fewer than that.
    const ROOM: usize = 400;
    request.max_tokens = ROOM;
    let tokens_so_far =
        |s: &troupe::engine::EngineStatus| s.num_prefill_tokens + s.num_decode_tokens;
    let before = tokens_so_far(&engine.status().await.unwrap());
    let prompt_len = request.prompt_ids.len();
    let mut stream = tokio::time::timeout(Duration::from_secs(60), engine.generate(request))
        .await
        .expect("generate answers")
        .unwrap();
    // Read every output but keep the stream: a dropped one would abort the request anyway.
    let mut choices = vec![troupe::engine::RequestOutput::default(); 3];
    while let Some(o) = tokio::time::timeout(Duration::from_secs(60), stream.next())
        .await
        .expect("every completion ends")
    {
        let c = &mut choices[o.index];
        c.token_ids.extend(o.token_ids);
        c.text.push_str(&o.text);
        c.finish_reason = o.finish_reason.or(c.finish_reason);
        c.stop_string = o.stop_string.or(c.stop_string.take());
    }
    let cut = free.text.find(&stop).unwrap();
    for c in &choices {
        assert_eq!(c.finish_reason, Some(FinishReason::Stop), "{c:?}");
        assert_eq!(c.stop_string.as_deref(), Some(stop.as_str()));
        assert_eq!(c.text, free.text[..cut], "stop string {stop:?}");
        // The tokens stop once the text met the stop string, a prefix of the free run's.
        let n = c.token_ids.len();
        assert!(n < free.token_ids.len(), "{n}");
        assert_eq!(c.token_ids, free.token_ids[..n]);
        assert!(tok.decode(&c.token_ids, true).unwrap().contains(&stop));
    }
    // The scheduler stopped each sequence: none ran on towards its ROOM tokens (the steps
    // in flight when the stop reached it aside: up to a quarter of them allowed, measured
    // ~27 a completion when a loaded CI machine starved the test's thread).
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while engine.status().await.unwrap().num_running > 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "a stopped sequence ran on"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let computed = tokens_so_far(&engine.status().await.unwrap()) - before;
    let kept: usize = choices.iter().map(|c| c.token_ids.len()).sum();
    assert!(
        computed as usize <= kept + 3 * (prompt_len + ROOM / 4),
        "{computed} tokens computed for {kept} kept"
    );
    drop(stream);
    engine.shutdown(true).await;
}
