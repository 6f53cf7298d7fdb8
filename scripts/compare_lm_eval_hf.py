#!/usr/bin/env python3
"""The committed lm-eval tasks (evals/lm_eval_tasks/) through `troupe serve`
(`local-completions`; by default, and with `--exact-activations`, the dequantized model's
arithmetic) and through lm-eval's HF backend (transformers, the same GGUF dequantized to
f32): accuracy of each, per-item agreement of the chosen answer and of the generated
answer, and the loglikelihood differences. BENCHMARKS.md quotes its table.

Needs lm-eval with the hf and api extras, and gguf (transformers reads the GGUF through it):

    python3 -m pip install "lm-eval[hf,api]==0.4.13" gguf
    python3 scripts/compare_lm_eval_hf.py target/release/troupe [GGUF]

GGUF defaults to the default model's file in troupe's cache ($TROUPE_HOME/models).
"""

import glob
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_lm_eval import MODEL, REPO, free_port, start  # noqa: E402

TASKS = "troupe_mc,troupe_gen"


def run_lm_eval(model, model_args, out):
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    args = [sys.executable, "-m", "lm_eval", "--model", model, "--model_args", model_args, "--tasks", TASKS,
            "--include_path", "evals/lm_eval_tasks", "--output_path", out, "--log_samples", "--batch_size", "8", "--device", "cpu"]
    run = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=3600)
    if run.returncode != 0:
        sys.exit(f"lm_eval {model} failed:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}")
    results = json.load(open(glob.glob(f"{out}/*/results_*.json")[0]))["results"]
    samples = {}
    for path in glob.glob(f"{out}/*/samples_*.jsonl"):
        task = os.path.basename(path).split("_20")[0].removeprefix("samples_")
        samples[task] = {json.loads(l)["doc_id"]: json.loads(l) for l in open(path)}
    return results, samples


def troupe_run(binary, out, *flags):
    port = free_port()
    server = start(binary, port, *flags)
    try:
        return run_lm_eval(
            "local-completions",
            f"base_url=http://127.0.0.1:{port}/v1/completions,model={MODEL},"
            "tokenizer_backend=remote,num_concurrent=2,max_retries=1,timeout=120",
            out)
    finally:
        server.terminate()
        server.wait(timeout=30)


def loglikelihood(samples, i, k):
    return float(samples[i]["resps"][k][0][0])


def compare(name, ours, ours_s, hf, hf_s):
    mc_ours, mc_hf = ours_s["troupe_mc"], hf_s["troupe_mc"]
    same_choice = sum(
        max(range(4), key=lambda k: loglikelihood(mc_ours, i, k))
        == max(range(4), key=lambda k: loglikelihood(mc_hf, i, k))
        for i in mc_ours)
    diffs = sorted(abs(loglikelihood(mc_ours, i, k) - loglikelihood(mc_hf, i, k)) for i in mc_ours for k in range(4))
    gen_ours, gen_hf = ours_s["troupe_gen"], hf_s["troupe_gen"]
    same_text = sum(gen_ours[i]["filtered_resps"][0].strip() == gen_hf[i]["filtered_resps"][0].strip()
                    for i in gen_ours)
    print(f"| {name} | troupe_mc acc | {ours['troupe_mc']['acc,none']:.3f} | {hf['troupe_mc']['acc,none']:.3f} | "
          f"same choice {same_choice}/{len(mc_ours)}; loglikelihood diff median {diffs[len(diffs) // 2]:.4f}, "
          f"max {diffs[-1]:.4f} |")
    print(f"| {name} | troupe_mc acc_norm | {ours['troupe_mc']['acc_norm,none']:.3f} | "
          f"{hf['troupe_mc']['acc_norm,none']:.3f} | |")
    print(f"| {name} | troupe_gen exact_match | {ours['troupe_gen']['exact_match,none']:.3f} | "
          f"{hf['troupe_gen']['exact_match,none']:.3f} | same answer {same_text}/{len(gen_ours)} |")


def main(binary, gguf):
    with tempfile.TemporaryDirectory() as tmp:
        default = troupe_run(binary, f"{tmp}/troupe")
        exact = troupe_run(binary, f"{tmp}/troupe-exact", "--exact-activations")
        hf = run_lm_eval(
            "hf", f"pretrained={os.path.dirname(gguf)},gguf_file={os.path.basename(gguf)},dtype=float32",
            f"{tmp}/hf")
    print("| troupe | task, metric | troupe | transformers (HF backend) | agreement |")
    print("|---|---|---:|---:|---|")
    compare("default (8-bit activations)", *default, *hf)
    compare("`--exact-activations`", *exact, *hf)


if __name__ == "__main__":
    home = os.environ.get("TROUPE_HOME", os.path.expanduser("~/.cache/troupe"))
    default = os.path.join(home, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")
    main(sys.argv[1] if len(sys.argv) > 1 else "target/release/troupe", sys.argv[2] if len(sys.argv) > 2 else default)
