use super::*;

#[test]
fn rates_parse() {
    assert_eq!(parse_rate("2.5"), Ok(2.5));
    assert_eq!(parse_rate("inf"), Ok(f64::INFINITY));
    assert!(parse_rate("0").is_err());
    assert!(parse_rate("-1").is_err());
    assert!(parse_rate("NaN").is_err());
    assert!(parse_rate("fast").is_err());
}

#[test]
fn arrivals_are_poisson_and_seeded() {
    let a = poisson_arrivals(20_000, 4.0, 7);
    assert_eq!(a, poisson_arrivals(20_000, 4.0, 7));
    assert_ne!(a, poisson_arrivals(20_000, 4.0, 8));
    assert_eq!(a[0], 0.0);
    assert!(a.windows(2).all(|w| w[1] >= w[0]));
    let gaps: Vec<f64> = a.windows(2).map(|w| w[1] - w[0]).collect();
    let n = gaps.len() as f64;
    let mean = gaps.iter().sum::<f64>() / n;
    let var = gaps.iter().map(|g| (g - mean).powi(2)).sum::<f64>() / n;
    // Exponential with rate 4: mean 0.25 and standard deviation 0.25 (±~2% at n=20k).
    assert!((mean - 0.25).abs() < 0.01, "mean {mean}");
    assert!((var.sqrt() - 0.25).abs() < 0.015, "sd {}", var.sqrt());
    assert!(
        poisson_arrivals(5, f64::INFINITY, 1)
            .iter()
            .all(|&t| t == 0.0)
    );
    assert!(poisson_arrivals(0, 1.0, 1).is_empty());
}

#[test]
fn prompts_have_exact_length_and_range() {
    let p = random_prompt_ids(128, 3, 0);
    assert_eq!(p.len(), 128);
    assert!(p.iter().all(|id| PROMPT_TOKEN_IDS.contains(id)));
    assert_eq!(p, random_prompt_ids(128, 3, 0));
    assert_ne!(p, random_prompt_ids(128, 3, 1));
    assert_ne!(p, random_prompt_ids(128, 4, 0));
    let distinct: std::collections::HashSet<_> = p.iter().collect();
    assert!(distinct.len() > 100, "{} distinct ids", distinct.len());
}

#[test]
fn percentiles_interpolate() {
    let v: Vec<f64> = (1..=10).map(f64::from).collect();
    assert_eq!(percentile(&v, 0.0), Some(1.0));
    assert_eq!(percentile(&v, 100.0), Some(10.0));
    assert_eq!(percentile(&v, 50.0), Some(5.5));
    assert!((percentile(&v, 90.0).unwrap() - 9.1).abs() < 1e-12);
    assert!((percentile(&v, 99.0).unwrap() - 9.91).abs() < 1e-12);
    assert_eq!(percentile(&[4.0], 99.0), Some(4.0));
    assert_eq!(percentile(&[], 50.0), None);
}

#[test]
fn events_parse() {
    let chunk = r#"{"id":"cmpl-1","choices":[{"index":0,"text":"hi","token_ids":[5,6],"finish_reason":null}]}"#;
    assert_eq!(parse_event(chunk), Ok(StreamEvent::Tokens(2)));
    assert_eq!(parse_event("[DONE]"), Ok(StreamEvent::Done));
    let finish = r#"{"choices":[{"index":0,"text":"","token_ids":[],"finish_reason":"length"}]}"#;
    assert_eq!(parse_event(finish), Ok(StreamEvent::Tokens(0)));
    let err = parse_event(r#"{"error":{"message":"rank lost","type":"server_error"}}"#);
    assert!(err.unwrap_err().contains("rank lost"));
    assert!(parse_event("{not json").is_err());
    // Text-only chunks (llama.cpp) count one token each.
    assert_eq!(
        parse_event(r#"{"choices":[{"text":"x"}]}"#),
        Ok(StreamEvent::Tokens(1))
    );
    assert!(parse_event(r#"{"object":"x"}"#).is_err());
}

#[test]
fn timings_from_events() {
    let events = [(0.5, 1), (0.6, 1), (0.8, 2)];
    let t = RequestTiming::from_events(&events, 0.9, 4).unwrap();
    assert_eq!(t.ttft_secs, 0.5);
    assert_eq!(t.num_output_tokens, 4);
    assert!(
        t.itl_secs
            .iter()
            .zip([0.1, 0.2])
            .all(|(a, b)| (a - b).abs() < 1e-12)
    );
    assert!((t.tpot_secs().unwrap() - (0.9 - 0.5) / 3.0).abs() < 1e-12);
    assert!(
        RequestTiming::from_events(&events, 0.9, 3).is_err(),
        "more than asked"
    );
    assert!(
        RequestTiming::from_events(&events, 0.9, 6).is_err(),
        "far fewer"
    );
    let folded = RequestTiming::from_events(&[(0.1, 1); 19], 1.0, 20).unwrap();
    assert_eq!(
        folded.num_output_tokens, 20,
        "one folded chunk is still a full run"
    );
    assert!(RequestTiming::from_events(&[], 0.9, 0).is_err());
    let one = RequestTiming::from_events(&[(0.2, 1)], 0.2, 1).unwrap();
    assert_eq!(one.tpot_secs(), None);
}

#[test]
fn summary_leaves_failures_out_of_latencies() {
    let ok = |ttft: f64, e2e: f64| {
        Ok(RequestTiming {
            ttft_secs: ttft,
            e2e_secs: e2e,
            itl_secs: vec![0.01; 2],
            num_output_tokens: 3,
        })
    };
    let results = vec![ok(0.1, 0.3), ok(0.3, 0.5), Err("refused".to_string())];
    let row = summarize(2.0, &results, 2.0);
    assert_eq!((row.completed, row.failed, row.rate.as_str()), (2, 1, "2"));
    assert_eq!(row.request_throughput, 1.0);
    assert_eq!(row.output_token_throughput, 3.0);
    assert!((row.ttft_p50_ms.unwrap() - 200.0).abs() < 1e-9);
    assert!((row.tpot_p99_ms.unwrap() - 100.0).abs() < 1e-9);
    assert!((row.itl_p50_ms.unwrap() - 10.0).abs() < 1e-9);
    let none = summarize(f64::INFINITY, &[Err("x".into())], 1.0);
    assert_eq!((none.rate.as_str(), none.ttft_p50_ms), ("inf", None));
    let table = format_table(&[row, none]);
    assert_eq!(table.lines().count(), 3);
    assert!(
        table
            .lines()
            .nth(2)
            .unwrap()
            .trim_start()
            .starts_with("inf")
    );
}

#[test]
fn written_prompts_are_the_requests_sent() {
    let text = prompts_file_lines(37, 11, 5, 3, 4);
    let lines = crate::protocol::jsonl::parse_prompts_file(&text, "prompts.jsonl").unwrap();
    assert_eq!(lines.len(), 4);
    for (i, line) in lines.iter().enumerate() {
        assert_eq!(
            line.prompt_ids.as_deref(),
            Some(&random_prompt_ids(37, 5, 3 + i as u64)[..])
        );
        assert_eq!(line.max_tokens, Some(11));
        assert_eq!(line.temperature, Some(0.0));
    }
}

#[test]
fn noise_images_are_seeded_pngs_of_their_size() {
    let size = images::parse_size("33x20").unwrap();
    assert_eq!(size, (33, 20));
    let a = images::noise_png(size, 7, 3, 0);
    assert_eq!(a, images::noise_png(size, 7, 3, 0));
    assert_ne!(a, images::noise_png(size, 7, 3, 1));
    assert_ne!(a, images::noise_png(size, 7, 4, 0));
    let decoded = image::load_from_memory(&a).unwrap();
    assert_eq!((decoded.width(), decoded.height()), (33, 20));
    for bad in ["33", "x20", "0x20", "33x5000", "ax b"] {
        assert!(images::parse_size(bad).is_err(), "{bad}");
    }
}

#[test]
fn chat_chunks_count_a_token_each() {
    let chunk = r#"{"choices":[{"index":0,"delta":{"content":"hé"}}]}"#;
    assert_eq!(parse_event(chunk), Ok(StreamEvent::Tokens(1)));
    let role = r#"{"choices":[{"index":0,"delta":{"role":"assistant"}}]}"#;
    assert_eq!(parse_event(role), Ok(StreamEvent::Tokens(0)));
    let usage = r#"{"choices":[],"usage":{"prompt_tokens":9,"completion_tokens":4}}"#;
    assert_eq!(parse_event(usage), Ok(StreamEvent::Usage(4)));
}
