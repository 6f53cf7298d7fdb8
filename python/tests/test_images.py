"""The Python package with images (issue 64), on a generated Qwen2.5-VL checkpoint
(`scripts/make_vision_goldens.py`, random weights): vLLM's `multi_modal_data` prompts with
PIL images and with files' bytes, and `chat` with `image_url` parts, give transformers'
greedy tokens (the goldens' references); the prompt comes back widened over its images;
mismatched or unsupported inputs are refused by name."""

import base64
import io
import json
import pathlib

import pytest
from PIL import Image as PIL  # pip-installed beside pytest by scripts/test.sh

import troupe

CASE = pathlib.Path(__file__).resolve().parents[2] / "tests" / "goldens" / "qwen25vl" / "a"
CASES = json.loads((CASE / "cases.json").read_text())
IMAGE_TOKEN = CASES["image_token_id"]


def greedy(n):
    return troupe.SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def png(i):
    return (CASE / "images" / f"{i}.png").read_bytes()


def collapsed(ids):
    """A widened prompt as a user writes it for vLLM: one placeholder per image."""
    out = []
    for t in ids:
        if t == IMAGE_TOKEN and out and out[-1] == IMAGE_TOKEN:
            continue
        out.append(t)
    return out


@pytest.fixture(scope="module")
def llm():
    engine = troupe.LLM(str(CASE), kv_cache_mib=8, block_size=4, exact_activations=True)
    yield engine
    engine.shutdown()


def test_multi_modal_data_prompts_answer_as_transformers(llm):
    # The goldens' chats: their widened prompts and transformers' greedy tokens.
    for chat in CASES["chats"]:
        want = chat["greedy"]
        images = [p["image"] for m in chat["messages"] for p in m["content"]
                  if isinstance(m["content"], list) and p["type"] == "image"]
        ids = collapsed(chat["ids"])
        pil = [PIL.open(io.BytesIO(png(i))) for i in images]
        as_bytes = [png(i) for i in images]
        outs = llm.generate([
            {"prompt_token_ids": ids, "multi_modal_data": {"image": pil}},
            {"prompt_token_ids": ids, "multi_modal_data": {"image": as_bytes}},
            # A lone image needs no list, as in vLLM.
            *([{"prompt_token_ids": ids, "multi_modal_data": {"image": pil[0]}}] if len(pil) == 1 else []),
        ], greedy(len(want)))
        for o in outs:
            assert o.outputs[0].token_ids == want
            assert o.prompt_token_ids == chat["ids"]
        # Streaming gives the same tokens.
        tokens = []
        for o in llm.generate_stream({"prompt_token_ids": ids, "multi_modal_data": {"image": pil}},
                                     greedy(len(want))):
            tokens += o.outputs[0].token_ids
            assert o.prompt_token_ids == chat["ids"]
        assert tokens == want


def test_chat_with_image_url_parts_answers_as_transformers(llm):
    for chat in CASES["chats"]:
        messages = []
        for m in chat["messages"]:
            content = m["content"]
            if isinstance(content, list):
                content = [{"type": "text", "text": p["text"]} if p["type"] == "text" else
                           {"type": "image_url", "image_url": {
                               "url": "data:image/png;base64," + base64.b64encode(png(p["image"])).decode()}}
                           for p in content]
            messages.append({"role": m["role"], "content": content})
        out = llm.chat(messages, greedy(len(chat["greedy"])))[0]
        assert out.prompt_token_ids == chat["ids"]
        assert out.outputs[0].token_ids == chat["greedy"]


def test_bad_image_inputs_are_refused_by_name(llm):
    ids = collapsed(CASES["chats"][0]["ids"])
    with pytest.raises(ValueError, match="2 images"):
        llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": [png(0), png(1)]}})
    with pytest.raises(ValueError, match="multi_modal_data image 0: the image"):
        llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": b"not an image"}})
    with pytest.raises(ValueError, match="'video' is not supported"):
        llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"video": [png(0)]}})
    with pytest.raises(ValueError, match="'mm_processor_kwargs'"):
        llm.generate({"prompt_token_ids": ids, "mm_processor_kwargs": {}})
    with pytest.raises(TypeError, match="multi_modal_data image 0 is a PIL image"):
        llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": 3}})
    remote = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}]
    with pytest.raises(ValueError, match="fetches no image URLs"):
        llm.chat(remote)
    # The engine serves on.
    want = CASES["chats"][0]["greedy"]
    out = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": png(0)}}, greedy(len(want)))
    assert out[0].outputs[0].token_ids == want
