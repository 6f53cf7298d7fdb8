#!/usr/bin/env python3
"""Drives a running `troupe serve` (started here, on the default model) with the official
`openai` Python SDK: chat (stream and not), completions with token ids, seeded
reproducibility, n > 1, API errors, the special-token guard and a client disconnect.

Run: python3 scripts/test_server_sdk.py target/release/troupe   (needs `pip install openai`)
"""

import json
import socket
import subprocess
import sys
import time
import urllib.request

import openai


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(binary):
    port = free_port()
    server = subprocess.Popen([binary, "serve", "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            try:
                urllib.request.urlopen(base + "/health", timeout=1)
                break
            except OSError:
                time.sleep(0.1)
        else:
            raise SystemExit("server did not come up: " + server.stderr.read1().decode())
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused")
        checks = run_checks(client, base)
    finally:
        server.terminate()
        server.wait(timeout=10)
    failed = [name for name, ok in checks if not ok]
    for name, ok in checks:
        print(("ok    " if ok else "FAIL  ") + name)
    print(f"{len(checks) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0


def run_checks(client, base):
    checks = []
    model = "smollm2-135m-instruct"
    ask = [{"role": "user", "content": "What is the capital of France?"}]

    models = client.models.list()
    checks.append(("models lists the served model", [m.id for m in models.data] == [model]))

    r = client.chat.completions.create(model=model, messages=ask, temperature=0, max_tokens=24)
    text = r.choices[0].message.content
    checks.append(("chat answers sensibly", "Paris" in text))
    checks.append(("chat reports usage", r.usage.completion_tokens > 0 and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens))

    chunks = list(client.chat.completions.create(model=model, messages=ask, temperature=0, max_tokens=24, stream=True,
                                                 stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    checks.append(("streamed chat equals the whole reply", streamed == text))
    checks.append(("stream ends with usage", chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == r.usage.completion_tokens))
    checks.append(("stream gives a finish reason", any(c.choices and c.choices[0].finish_reason for c in chunks)))

    seeded = [client.chat.completions.create(model=model, messages=ask, temperature=0.9, seed=7, max_tokens=16)
              .choices[0].message.content for _ in range(2)]
    checks.append(("a seed reproduces a sampled reply", seeded[0] == seeded[1]))

    n2 = client.chat.completions.create(model=model, messages=ask, temperature=1.0, n=3, max_tokens=12, seed=3)
    checks.append(("n=3 gives three choices", sorted(c.index for c in n2.choices) == [0, 1, 2]))

    c = client.completions.create(model=model, prompt=[504, 3575, 282, 4649, 314], temperature=0, max_tokens=4)
    checks.append(("completions take token ids", "Paris" in c.choices[0].text))

    try:
        client.chat.completions.create(model=model, messages=ask, temperature=-1)
        checks.append(("bad temperature is a 400", False))
    except openai.BadRequestError as e:
        checks.append(("bad temperature is a 400 naming it", "temperature" in str(e)))
    try:
        client.chat.completions.create(model="gpt-imaginary", messages=ask)
        checks.append(("unknown model is a 404", False))
    except openai.NotFoundError:
        checks.append(("unknown model is a 404", True))
    try:
        client.chat.completions.create(model=model, messages=[])
        checks.append(("empty messages is a 400", False))
    except openai.BadRequestError as e:
        checks.append(("empty messages is a 400 naming messages", "messages" in str(e)))

    plain = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}], max_tokens=1)
    inject = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x<|im_start|>"}], max_tokens=1)
    # As text, `<|im_start|>` is several ordinary tokens, not the one control token.
    checks.append(("special tokens in user text stay text", inject.usage.prompt_tokens - plain.usage.prompt_tokens > 1))

    # A client that goes away mid-stream: the server aborts its request and stays healthy.
    req = urllib.request.Request(base + "/v1/chat/completions", method="POST", headers={"content-type": "application/json"},
                                 data=json.dumps({"messages": ask, "max_tokens": 400, "stream": True, "ignore_eos": True}).encode())
    resp = urllib.request.urlopen(req)
    resp.read(200)
    resp.close()
    time.sleep(0.5)
    health = json.load(urllib.request.urlopen(base + "/health"))
    checks.append(("server healthy after a disconnect", health == {"status": "ok"}))
    return checks


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
