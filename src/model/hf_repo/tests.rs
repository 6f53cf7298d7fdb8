use super::*;

fn spec(s: &str) -> RepoSpec {
    RepoSpec::parse(s).unwrap_or_else(|| panic!("`{s}` is a hub id"))
}

#[test]
fn hub_ids_parse_and_paths_do_not() {
    assert_eq!(
        spec("Qwen/Qwen3-0.6B"),
        RepoSpec {
            repo_id: "Qwen/Qwen3-0.6B".into(),
            revision: "main".into(),
            gguf: None
        }
    );
    let s = spec("unsloth/Qwen3-0.6B-GGUF@v1.0:Q4_K_M");
    assert_eq!(
        (s.repo_id.as_str(), s.revision.as_str()),
        ("unsloth/Qwen3-0.6B-GGUF", "v1.0")
    );
    assert_eq!(s.gguf.as_deref(), Some("Q4_K_M"));
    for not_an_id in [
        "model.gguf",
        "./org/name",
        "/abs/org/name",
        "org/name/extra",
        "org/",
        "/name",
        "org/..",
        "org/name@",
        "../x",
        "smollm2-135m-instruct",
        "org/na me",
    ] {
        assert_eq!(RepoSpec::parse(not_an_id), None, "{not_an_id}");
    }
}

#[test]
fn only_what_the_model_needs_is_chosen() {
    let files = [
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "README.md",
        ".gitattributes",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
        "original/consolidated.00.pth",
        "onnx/model.onnx",
        "pytorch_model.bin",
    ];
    let got = choose_files(&spec("o/m"), &files).unwrap();
    // The shards come from the index once it is fetched.
    assert_eq!(
        got,
        [
            "config.json",
            "tokenizer.json",
            "tokenizer_config.json",
            "model.safetensors.index.json"
        ]
    );
    // Mistral's second copy of the weights is not the HF layout.
    let mistral = [
        "config.json",
        "model.safetensors",
        "consolidated.safetensors",
        "tokenizer.json",
    ];
    assert_eq!(
        choose_files(&spec("o/m"), &mistral).unwrap(),
        ["config.json", "tokenizer.json", "model.safetensors"]
    );
}

#[test]
fn a_gguf_file_is_chosen_by_quant_or_name_or_refused_with_the_choices() {
    let files = ["README.md", "m-Q4_K_M.gguf", "m-Q8_0.gguf", "m-Q4_K_S.gguf"];
    assert_eq!(
        choose_files(&spec("o/m:q8_0"), &files).unwrap(),
        ["m-Q8_0.gguf"]
    );
    assert_eq!(
        choose_files(&spec("o/m:m-Q4_K_S.gguf"), &files).unwrap(),
        ["m-Q4_K_S.gguf"]
    );
    for (s, needle) in [
        ("o/m", "pick one GGUF file"),
        ("o/m:Q4_K", "matches several"),
        ("o/m:IQ2", "no GGUF file matches `IQ2`"),
    ] {
        let e = choose_files(&spec(s), &files).unwrap_err().to_string();
        assert!(
            e.contains(needle) && e.contains("m-Q4_K_S.gguf"),
            "{s}: {e}"
        );
    }
    assert_eq!(
        choose_files(&spec("o/m"), &["only.gguf"]).unwrap(),
        ["only.gguf"]
    );
    let e = choose_files(&spec("o/m"), &["README.md"])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("neither safetensors weights nor a GGUF file"),
        "{e}"
    );
    let e = choose_files(&spec("o/m"), &["model.safetensors"])
        .unwrap_err()
        .to_string();
    assert!(e.contains("no config.json"), "{e}");
}

#[test]
fn a_gguf_file_flag_joins_a_hub_id_or_a_directory_and_nothing_else() {
    let joined = with_gguf_file("o/m@v1", "m-Q8_0.gguf").unwrap();
    assert_eq!(spec(&joined).gguf.as_deref(), Some("m-Q8_0.gguf"));
    assert_eq!(spec(&joined).revision, "v1");
    let dir = std::env::temp_dir();
    let in_dir = with_gguf_file(dir.to_str().unwrap(), "x.gguf").unwrap();
    assert_eq!(std::path::PathBuf::from(in_dir), dir.join("x.gguf"));
    for (model, file, needle) in [
        ("o/m:Q4_K_M", "m-Q8_0.gguf", "names its GGUF file already"),
        ("o/m", "sub/x.gguf", "not a file name"),
        ("model.gguf", "x.gguf", "neither a hub id"),
    ] {
        let e = with_gguf_file(model, file).unwrap_err().to_string();
        assert!(
            e.contains("--gguf-file") && e.contains(needle),
            "{model} {file}: {e}"
        );
    }
}
