//! The engine's and the server's flags on live processes, read from outside: CPU ranks'
//! pools and their cores from /proc (`--cpu-affinity`, `--threads`), `serve MODEL` and
//! `--max-model-len` as vLLM users type them, and `--log-format json`.

mod common;

use std::path::Path;

use common::cli::{assert_clear_error, tiny, troupe};

/// The cores of this process (what `--cpu-affinity auto` shares out), from procfs.
fn allowed_cores() -> Vec<usize> {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let list = status
        .lines()
        .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
        .unwrap()
        .trim()
        .to_string();
    list.split(',')
        .flat_map(|part| match part.split_once('-') {
            Some((a, b)) => (a.parse().unwrap()..=b.parse().unwrap()).collect::<Vec<usize>>(),
            None => vec![part.parse().unwrap()],
        })
        .collect()
}

/// Each CPU rank's pool threads of a live process (named `troupe-rank{r}-{i}`) and the
/// cores the kernel lets each run on, read from /proc: the real masks, not the engine's
/// report of them.
fn rank_thread_masks(pid: u32) -> std::collections::BTreeMap<usize, Vec<Vec<usize>>> {
    let mut ranks = std::collections::BTreeMap::<usize, Vec<Vec<usize>>>::new();
    for task in std::fs::read_dir(format!("/proc/{pid}/task")).unwrap() {
        let dir = task.unwrap().path();
        let Ok(name) = std::fs::read_to_string(dir.join("comm")) else {
            continue;
        };
        let Some(rank) = name
            .trim()
            .strip_prefix("troupe-rank")
            .and_then(|r| r.split('-').next())
            .and_then(|r| r.parse().ok())
        else {
            continue;
        };
        let status = std::fs::read_to_string(dir.join("status")).unwrap();
        let list = status
            .lines()
            .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
            .unwrap();
        let mask = troupe::runner::affinity::parse_cpulist(list).unwrap();
        ranks.entry(rank).or_default().push(mask);
    }
    ranks
}

/// `generate` from prompt `5` with `extra` flags (for the refusals).
fn generate_one(model: &str, extra: &[&str]) -> std::process::Output {
    let mut args = vec!["generate", "--model", model, "--prompt-ids", "5"];
    args.extend_from_slice(extra);
    troupe(&args)
}

/// `--threads` sizes every CPU rank's pool, and under `--cpu-affinity auto` pins it inside
/// the rank's share of the cores (it was ignored there: a rank sized its pool from its
/// share); more threads than a share holds are refused by name; with affinity off the
/// pool has that many threads, unpinned.
#[test]
fn threads_size_each_cpu_ranks_pool_inside_its_share() {
    let allowed = allowed_cores();
    let num_ranks = if allowed.len() >= 2 { 2 } else { 1 };
    let tp = num_ranks.to_string();
    let model = tiny("tiny-llama");
    let serve = |args: &[&str]| common::process::serve_model(Path::new(&model), args, &[]);
    let server = serve(&["--tp", &tp, "--threads", "1"]);
    let ranks = rank_thread_masks(server.child.id());
    drop(server);
    assert_eq!(ranks.len(), num_ranks, "{ranks:?}");
    let mut used = Vec::new();
    for masks in ranks.values() {
        assert_eq!(masks.len(), 1, "one thread a rank: {ranks:?}");
        assert_eq!(masks[0].len(), 1, "pinned to one core: {ranks:?}");
        assert!(
            allowed.contains(&masks[0][0]),
            "{ranks:?} outside {allowed:?}"
        );
        used.push(masks[0][0]);
    }
    used.dedup();
    assert_eq!(used.len(), num_ranks, "ranks share a core: {ranks:?}");

    let server = serve(&["--threads", "3", "--cpu-affinity", "off"]);
    let ranks = rank_thread_masks(server.child.id());
    drop(server);
    assert_eq!(ranks.get(&0).map(Vec::len), Some(3), "{ranks:?}");
    assert!(ranks[&0].iter().all(|m| m == &allowed), "{ranks:?}");

    let share = allowed.len() / num_ranks;
    let too_many = (share + 1).to_string();
    let refused = generate_one(&model, &["--tp", &tp, "--threads", &too_many]);
    assert_clear_error(&refused, "--threads");
    assert_clear_error(&generate_one(&model, &["--threads", "0"]), "--threads");
}

#[test]
fn cpu_ranks_are_pinned_to_disjoint_cores_and_reported_unless_turned_off() {
    let model = tiny("tiny-llama");
    let run = |tp: &str, affinity: &str| {
        let out = troupe(&[
            "generate",
            "--model",
            &model,
            "--prompt-ids",
            "5,6,7,8",
            "--max-tokens",
            "4",
            "--ignore-eos",
            "--json",
            "--stats",
            "-",
            "--tp",
            tp,
            "--cpu-affinity",
            affinity,
        ]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let stderr = String::from_utf8_lossy(&out.stderr).to_string();
        let stats: serde_json::Value =
            serde_json::from_str(stderr.lines().last().unwrap()).unwrap();
        let ranks: Vec<String> = stats["cpu_affinity"]
            .as_array()
            .unwrap_or_else(|| panic!("no cpu_affinity in {stderr}"))
            .iter()
            .map(|v| v.as_str().unwrap().to_string())
            .collect();
        (ranks, common::cli::token_ids(&out))
    };
    let allowed = allowed_cores();
    let (off, off_tokens) = run("1", "off");
    assert_eq!(off, vec!["unpinned"]);
    let (one, one_tokens) = run("1", "auto");
    assert_eq!(one.len(), 1);
    assert_eq!(one_tokens, off_tokens, "pinning changed the tokens");
    if allowed.len() >= 2 {
        let (two, two_tokens) = run("2", "auto");
        assert_eq!(two_tokens, off_tokens);
        assert_eq!(two.len(), 2);
        assert_ne!(two[0], two[1], "two ranks on the same cores: {two:?}");
    }
    assert_clear_error(
        &generate_one(&model, &["--cpu-affinity", "numa"]),
        "--cpu-affinity",
    );
}

/// What a vLLM user types first: `troupe serve MODEL` (positional, as `vllm serve`) and
/// `--max-model-len`, which caps the context `/v1/models` reports and a prompt may fill
/// (more than the model's own is refused by name, as is a model given twice).
#[test]
fn serve_takes_the_model_positionally_and_max_model_len_caps_the_context() {
    let model = tiny("tiny-llama");
    let server = common::process::serve_with(&[&model, "--max-model-len", "24"], &[]);
    let headers = [("host", "127.0.0.1"), ("content-type", "application/json")];
    let models = common::server::raw_request(server.addr, "GET", "/v1/models", &headers, b"");
    assert_eq!(
        models.json()["data"][0]["max_model_len"],
        24,
        "{:?}",
        models.json()
    );
    let ask = |n: usize| {
        let body = serde_json::json!({"prompt": vec![5; n], "max_tokens": 1});
        common::server::raw_request(
            server.addr,
            "POST",
            "/v1/completions",
            &headers,
            body.to_string().as_bytes(),
        )
    };
    assert_eq!(ask(20).status, 200);
    let long = ask(30);
    assert_eq!(long.status, 400);
    assert!(
        long.json()["error"]["message"]
            .as_str()
            .unwrap()
            .contains("24"),
        "{:?}",
        long.json()
    );
    drop(server);
    let out = generate_one(&model, &["--max-model-len", "999999"]);
    assert_clear_error(&out, "--max-model-len 999999");
    let out = troupe(&["serve", &model, "--model", &model]);
    assert_clear_error(&out, "--model");
}

/// `serve --log-format json`: every log line is one JSON object, a request's lines carry
/// its span (the request id), and the end user a request names (`user`) is in its line.
#[test]
fn json_logs_are_one_object_a_line_with_the_requests_span() {
    let dir = common::scratch_dir("json-logs");
    let log = dir.join("serve.log");
    let model = tiny("tiny-llama");
    let server = common::process::serve_logging_to(
        &[&model, "--log-format", "json"],
        &[("RUST_LOG", "troupe=info")],
        std::process::Stdio::from(std::fs::File::create(&log).unwrap()),
    );
    let headers = [
        ("host", "127.0.0.1"),
        ("content-type", "application/json"),
        ("x-request-id", "req-json-7"),
    ];
    let body = br#"{"prompt": [5, 6], "max_tokens": 2, "user": "u-42"}"#;
    let r = common::server::raw_request(server.addr, "POST", "/v1/completions", &headers, body);
    assert_eq!(r.status, 200);
    drop(server);
    let text = std::fs::read_to_string(&log).unwrap();
    let lines: Vec<serde_json::Value> = text
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: not JSON: {l}")))
        .collect();
    assert!(!lines.is_empty(), "no logs");
    let user = lines
        .iter()
        .find(|l| l["fields"]["user"] == "u-42")
        .unwrap_or_else(|| panic!("no line names the user: {text}"));
    assert_eq!(user["span"]["name"], "request", "{user}");
    assert_eq!(user["span"]["id"], "req-json-7", "{user}");
}
