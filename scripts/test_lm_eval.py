#!/usr/bin/env python3
"""lm-evaluation-harness against `troupe serve` (a real server process, the default model,
the `lm_eval` CLI): the committed tasks of evals/lm_eval_tasks/ through `local-completions`
(loglikelihood by `echo` + prompt logprobs, generate-until) and `local-chat-completions`
(generate-until through the model's chat template), with lm-eval tokenizing through the
server's `/tokenizer_info` and `/tokenize`.

Checks what a deployment check would: every item answered, the multiple-choice accuracy far
above chance, the two-shot answers mostly right, and each loglikelihood lm-eval computed
from the echoed logprobs equal to the sum the server reports for the same tokens.

    python3 scripts/test_lm_eval.py target/release/troupe
"""

import glob
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = "smollm2-135m-instruct"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(binary, port, *flags):
    server = subprocess.Popen([binary, "serve", "--port", str(port), *flags], stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE)
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return server
        except OSError:
            if server.poll() is not None:
                sys.exit("troupe serve exited: " + server.stderr.read().decode())
            time.sleep(0.2)
    server.kill()
    sys.exit("troupe serve did not come up within 120 s")


def lm_eval(model, base, tasks, out, *extra):
    args = [sys.executable, "-m", "lm_eval", "--model", model, "--model_args",
            f"base_url={base},model={MODEL},tokenizer_backend=remote,num_concurrent=2,max_retries=1,timeout=120",
            "--tasks", tasks, "--include_path", "evals/lm_eval_tasks", "--output_path", out,
            "--log_samples", *extra]
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    run = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
    if run.returncode != 0:
        sys.exit(f"lm_eval {model} failed:\n{run.stdout[-4000:]}\n{run.stderr[-4000:]}")
    results = json.load(open(glob.glob(f"{out}/*/results_*.json")[0]))["results"]
    samples = {}
    for path in glob.glob(f"{out}/*/samples_*.jsonl"):
        task = os.path.basename(path).split("_20")[0].removeprefix("samples_")
        samples[task] = [json.loads(line) for line in open(path)]
    return results, samples


def post(port, path, body):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    return json.load(urllib.request.urlopen(req, timeout=120))


def main(binary):
    port = free_port()
    server = start(binary, port)
    checks = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            results, samples = lm_eval("local-completions", f"http://127.0.0.1:{port}/v1/completions",
                                       "troupe_mc,troupe_gen", f"{tmp}/completions")
            mc, gen = results["troupe_mc"], results["troupe_gen"]
            print(f"local-completions: troupe_mc acc {mc['acc,none']:.3f} acc_norm {mc['acc_norm,none']:.3f}, "
                  f"troupe_gen exact_match {gen['exact_match,none']:.3f}")
            checks.append(("every multiple-choice item scored", len(samples["troupe_mc"]) == 40))
            checks.append(("every generation item answered", len(samples["troupe_gen"]) == 24))
            checks.append(("multiple choice far above chance (0.25)", mc["acc,none"] >= 0.8))
            checks.append(("two-shot answers mostly right", gen["exact_match,none"] >= 0.5))
            # lm-eval's loglikelihood of a choice is the sum of the continuation's echoed
            # logprobs: the server scoring context + choice must give the same sum.
            agree = 0
            for s in samples["troupe_mc"][:6]:
                context = s["arguments"]["gen_args_0"]["arg_0"]
                for k, choice in enumerate(s["doc"]["choices"]):
                    ctx = post(port, "/tokenize", {"prompt": context, "add_special_tokens": False})["tokens"]
                    cont = post(port, "/tokenize", {"prompt": context + choice, "add_special_tokens": False})["tokens"]
                    scored = post(port, "/v1/completions", {"model": MODEL, "prompt": cont, "max_tokens": 0,
                                                            "echo": True, "logprobs": 1, "temperature": 0})
                    lps = scored["choices"][0]["logprobs"]["token_logprobs"][len(ctx):]
                    want = float(s["resps"][k][0][0])
                    agree += abs(sum(lps) - want) < 1e-3
            checks.append(("lm-eval's loglikelihoods are the echoed logprobs' sums", agree == 24))
            results, samples = lm_eval("local-chat-completions", f"http://127.0.0.1:{port}/v1/chat/completions",
                                       "troupe_gen", f"{tmp}/chat", "--apply_chat_template")
            chat = results["troupe_gen"]
            print(f"local-chat-completions: troupe_gen exact_match {chat['exact_match,none']:.3f}")
            answers = [s["resps"][0][0] for s in samples["troupe_gen"]]
            checks.append(("chat answers every item", len(answers) == 24 and all(a.strip() for a in answers)))
    finally:
        server.terminate()
        server.wait(timeout=30)
    failed = [name for name, ok in checks if not ok]
    for name, ok in checks:
        print(("ok   " if ok else "FAIL ") + name)
    if failed:
        sys.exit(f"{len(failed)} lm-eval check(s) failed")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "target/release/troupe")
