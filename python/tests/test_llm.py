"""The Python package against the default model: the offline API (generate, chat,
streaming, logprobs, prompt logprobs, seeds, n) agrees with the `troupe` command's own
`generate --json` on the same prompts, bad arguments are refused by name, and the
`troupe` entry point runs."""

import json
import os
import random
import shutil
import subprocess
import sys
import time

import pytest

import troupe

GREEDY = troupe.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
# The entry point pip installed beside this interpreter (the venv need not be active).
TROUPE = shutil.which("troupe", path=os.path.dirname(sys.executable))


@pytest.fixture(scope="module")
def llm():
    engine = troupe.LLM(kv_cache_mib=64)
    yield engine
    engine.shutdown()


def cli_generate(*args):
    """`troupe generate --json` through the installed entry point."""
    out = subprocess.run([TROUPE, "generate", "--json", *args], capture_output=True,
                         text=True, timeout=300, check=True)
    return [json.loads(line) for line in out.stdout.splitlines()]


def random_id_prompts(n, seed):
    rng = random.Random(seed)
    # Ordinary vocabulary ids (SmolLM2's control tokens are 0..=16).
    return [[rng.randrange(17, 40000) for _ in range(rng.randrange(3, 24))] for _ in range(n)]


def test_a_batch_equals_the_command_line_one_prompt_at_a_time(llm):
    prompts = random_id_prompts(5, 3)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    assert [o.prompt_token_ids for o in outs] == prompts
    for p, o in zip(prompts, outs):
        want = cli_generate("--prompt-ids", ",".join(map(str, p)), "--max-tokens", "12", "--ignore-eos")[0]
        assert o.outputs[0].token_ids == want["token_ids"]
        assert o.outputs[0].text == want["text"]
        assert o.outputs[0].finish_reason == "length" and o.finished


def test_text_prompts_are_encoded_as_the_command_line_encodes_them(llm):
    out = llm.generate("The capital of France is", GREEDY)[0]
    want = cli_generate("--prompt", "The capital of France is", "--max-tokens", "12", "--ignore-eos")[0]
    assert out.prompt_token_ids == want["prompt_ids"] == llm.encode("The capital of France is")
    assert out.outputs[0].token_ids == want["token_ids"]
    assert out.prompt == "The capital of France is"


def test_chat_renders_the_template_as_the_command_line_does(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}], GREEDY)[0]
    want = cli_generate("--chat", "--prompt", "What is the capital of France?", "--max-tokens", "12",
                        "--ignore-eos")[0]
    assert out.prompt_token_ids == want["prompt_ids"]
    assert out.outputs[0].text == want["text"]
    two = llm.chat([[{"role": "user", "content": "Hi"}], [{"role": "user", "content": "Bye"}]], GREEDY)
    assert len(two) == 2 and two[0].prompt_token_ids != two[1].prompt_token_ids


def test_logprobs_are_shaped_as_vllms(llm):
    params = troupe.SamplingParams(temperature=0, max_tokens=6, logprobs=3, prompt_logprobs=2, ignore_eos=True)
    prompt = random_id_prompts(1, 9)[0]
    out = llm.generate({"prompt_token_ids": prompt}, params)[0]
    c = out.outputs[0]
    assert len(c.logprobs) == len(c.token_ids)
    for token, position in zip(c.token_ids, c.logprobs):
        # Greedy: the chosen token is the likeliest.
        assert position[token].rank == 1
        ranks = sorted(lp.rank for lp in position.values())
        assert ranks == [1, 2, 3]
        assert all(lp.logprob <= 0 for lp in position.values())
    assert c.cumulative_logprob == pytest.approx(sum(p[t].logprob for t, p in zip(c.token_ids, c.logprobs)))
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for token, position in zip(prompt[1:], out.prompt_logprobs[1:]):
        assert token in position and len(position) in (2, 3)
        # The prompt token's rank is its place in the whole vocabulary: among the top two,
        # or past them (and then a third entry).
        rank = position[token].rank
        assert (rank <= 2) == (len(position) == 2), (rank, position)
        best = max(lp.logprob for lp in position.values())
        assert (rank == 1) == (position[token].logprob == best)
    # Scoring the prompt and what was generated gives the generated tokens' logprobs.
    scored = llm.generate({"prompt_token_ids": prompt + c.token_ids},
                          troupe.SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))[0]
    for j, (token, position) in enumerate(zip(c.token_ids, c.logprobs)):
        got = scored.prompt_logprobs[len(prompt) + j][token].logprob
        assert got == pytest.approx(position[token].logprob, abs=1e-3)


def test_streaming_yields_the_same_text_and_can_stop_early(llm):
    whole = llm.generate("Once upon a time", GREEDY)[0].outputs[0]
    deltas = list(llm.generate_stream("Once upon a time", GREEDY))
    assert "".join(d.outputs[0].text for d in deltas) == whole.text
    assert sum((d.outputs[0].token_ids for d in deltas), []) == whole.token_ids
    assert deltas[-1].outputs[0].finish_reason == "length"
    # Within the test engine's KV pool (1 456 tokens), and seconds of decoding on a CPU.
    long = troupe.SamplingParams(temperature=0, max_tokens=1400, ignore_eos=True)
    stream = llm.generate_stream("Once upon a time", long)
    next(stream)
    assert llm.get_num_unfinished_requests() == 1
    stream.close()
    # Closing aborts the request: it leaves the engine long before its 1 400 tokens.
    deadline = time.monotonic() + 2
    while llm.get_num_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert llm.get_num_unfinished_requests() == 0
    # The engine goes on serving.
    assert llm.generate("Once upon a time", GREEDY)[0].outputs[0].token_ids == whole.token_ids


def test_seeds_and_n(llm):
    params = troupe.SamplingParams(temperature=1.0, max_tokens=10, seed=7, n=3)
    a = llm.generate("Tell me a story", params)[0]
    b = llm.generate("Tell me a story", params)[0]
    assert len(a.outputs) == 3
    assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    assert len({tuple(o.token_ids) for o in a.outputs}) > 1


def test_bad_arguments_are_refused_by_name(llm):
    with pytest.raises(TypeError):
        troupe.SamplingParams(temprature=0.5)
    with pytest.raises(ValueError, match="temperature"):
        llm.generate("x", troupe.SamplingParams(temperature=-1))
    with pytest.raises(ValueError, match="prompt_logprobs"):
        llm.generate("x", troupe.SamplingParams(prompt_logprobs=50))
    with pytest.raises(ValueError, match="no_such_flag"):
        troupe.LLM(no_such_flag=1)
    # Even a switch left off is checked (vLLM's spelling is not ours).
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        troupe.LLM(enable_prefix_caching=False)
    with pytest.raises(ValueError, match="--block-size"):
        troupe.LLM(block_size=0)
    with pytest.raises(ValueError, match="2 sampling_params for 1 prompts"):
        llm.generate(["x"], [GREEDY, GREEDY])
    with pytest.raises(ValueError, match="token id"):
        llm.generate({"prompt_token_ids": [10**7]}, GREEDY)


def test_the_troupe_command_is_installed():
    help_text = subprocess.run([TROUPE, "--help"], capture_output=True, text=True, timeout=60)
    assert help_text.returncode == 0 and "generate" in help_text.stdout
    bad = subprocess.run([TROUPE, "generate", "--no-such-flag"], capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2 and "--no-such-flag" in bad.stderr
