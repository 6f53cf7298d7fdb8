#!/usr/bin/env python3
"""Goldens for the Qwen2.5-VL path (issue 64): small random checkpoints of generated
configs, random images of odd sizes and aspect ratios, and what transformers makes of them.

For each case under tests/goldens/qwen25vl/<case>/:
  config.json, preprocessor_config.json, model.safetensors   the checkpoint (bf16 weights;
      case "b" keeps the hub's older tensor names: `visual.`, `model.layers.`)
  images/<i>.png                                              the images
  reference.safetensors   pixel_values_pil_<i> / pixel_values_tv_<i> (both of transformers'
      image processor backends), image_embeds_<i> (the vision encoder's rows),
      logits_<p> (every position of prompt p), greedy_<p> (8 greedy tokens after it)
  cases.json              the prompts: token ids with -1-i where image i's placeholders go,
      and each image's grid

Run: python3 scripts/make_vision_goldens.py   (versions: scripts/requirements-goldens.txt,
plus torchvision and pillow for the two processor backends).
"""

import json
import random
import shutil
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from safetensors.torch import save_file
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor

OUT = Path(__file__).resolve().parent.parent / "tests" / "goldens" / "qwen25vl"
# Byte-level tokens 0..255, then Qwen2.5-VL's special tokens.
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
            "<|image_pad|>", "<|video_pad|>"]
VOCAB = 256 + len(SPECIALS) + 1
IMAGE_TOKEN, VIDEO_TOKEN = 256 + SPECIALS.index("<|image_pad|>"), 256 + SPECIALS.index("<|video_pad|>")
VISION_START, VISION_END = 256 + SPECIALS.index("<|vision_start|>"), 256 + SPECIALS.index("<|vision_end|>")
IM_END = 256 + SPECIALS.index("<|im_end|>")
# Qwen2.5-VL's chat template (images and text; its video branch left out).
CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif 'text' in content %}{{ content['text'] }}{% endif %}"
    "{% endfor %}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_tokenizer(d: Path) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    assert tok.token_to_id("<|image_pad|>") == IMAGE_TOKEN
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": CHAT_TEMPLATE, "eos_token": "<|im_end|>", "bos_token": None,
        "add_bos_token": False, "tokenizer_class": "Qwen2TokenizerFast"}, indent=1))


def random_image(rng: random.Random, h: int, w: int) -> Image.Image:
    # Smooth gradients plus noise: resampling errors show on both.
    y, x = np.mgrid[0:h, 0:w]
    chans = []
    for _ in range(3):
        a, b, c = (rng.uniform(-3, 3) for _ in range(3))
        base = 127 + 90 * np.sin(a * x / w * np.pi + b * y / h * np.pi + c)
        noise = np.array([rng.gauss(0, 25) for _ in range(h * w)]).reshape(h, w)
        chans.append(np.clip(base + noise, 0, 255))
    return Image.fromarray(np.stack(chans, -1).astype(np.uint8), "RGB")


def make_case(name: str, seed: int, hub_names: bool) -> None:
    rng = random.Random(seed)
    torch.manual_seed(seed)
    heads = rng.choice([2, 4])
    head_dim = rng.choice([16, 32])
    half = head_dim // 2
    t = rng.randint(1, half // 3)
    h = rng.randint(1, half - t - 1)
    mrope = [t, h, half - t - h]
    v_heads = rng.choice([2, 4])
    v_hidden = v_heads * rng.choice([8, 16])
    depth = rng.randint(2, 4)
    text_hidden = heads * head_dim
    cfg = Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=VOCAB,
            hidden_size=text_hidden,
            intermediate_size=rng.choice([48, 96]),
            num_hidden_layers=rng.randint(1, 3),
            num_attention_heads=heads,
            num_key_value_heads=rng.choice([1, heads]),
            head_dim=head_dim,
            max_position_embeddings=512,
            rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": mrope},
            tie_word_embeddings=False,
            eos_token_id=IM_END,
            bos_token_id=None,
        ),
        vision_config=dict(
            depth=depth,
            hidden_size=v_hidden,
            intermediate_size=rng.choice([32, 64]),
            num_heads=v_heads,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            window_size=rng.choice([56, 112]),
            fullatt_block_indexes=sorted(rng.sample(range(depth), rng.randint(0, 2))),
            out_hidden_size=text_hidden,
        ),
        image_token_id=IMAGE_TOKEN,
        video_token_id=VIDEO_TOKEN,
        vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END,
        vocab_size=VOCAB,
    )
    model = Qwen2_5_VLForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            # Wider than the 0.02 init so layers move the logits; rounded to bf16 so the
            # stored checkpoint and the reference are the same weights.
            p.copy_((torch.randn_like(p) * 0.15).to(torch.bfloat16).to(torch.float32))
    d = OUT / name
    if d.exists():
        shutil.rmtree(d)
    (d / "images").mkdir(parents=True)
    model.save_pretrained(d, safe_serialization=True)
    state = {k: v.to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    if hub_names:
        state = {
            k.replace("model.language_model.", "model.").replace("model.visual.", "visual."): v
            for k, v in state.items()
        }
    for f in d.glob("model*.safetensors*"):
        f.unlink()
    save_file(state, d / "model.safetensors", metadata={"format": "pt"})
    min_px, max_px = 28 * 28 * 2, 28 * 28 * rng.choice([24, 48])
    proc_args = dict(min_pixels=min_px, max_pixels=max_px)
    pil = Qwen2VLImageProcessorPil(**proc_args)
    tv = Qwen2VLImageProcessor(**proc_args)
    pil.save_pretrained(d)
    pre = json.loads((d / "preprocessor_config.json").read_text())
    pre.update(min_pixels=min_px, max_pixels=max_px)
    (d / "preprocessor_config.json").write_text(json.dumps(pre, indent=2))

    ref = {}
    images = []
    for i in range(4):
        hh, ww = rng.randint(9, 160), rng.randint(9, 160)
        if i == 3:
            hh, ww = rng.randint(3, 12), rng.randint(60, 200)  # long and thin
        img = random_image(rng, hh, ww)
        img.save(d / "images" / f"{i}.png")
        img = Image.open(d / "images" / f"{i}.png")
        a = pil(images=[img], return_tensors="pt")
        b = tv(images=[img], return_tensors="pt")
        assert torch.equal(a["image_grid_thw"], b["image_grid_thw"])
        ref[f"pixel_values_pil_{i}"] = a["pixel_values"].float().contiguous()
        ref[f"pixel_values_tv_{i}"] = b["pixel_values"].float().contiguous()
        with torch.no_grad():
            emb = model.model.get_image_features(a["pixel_values"], a["image_grid_thw"]).pooler_output[0]
        ref[f"image_embeds_{i}"] = emb.float().contiguous()
        images.append({"size": [hh, ww], "grid": a["image_grid_thw"][0].tolist()})

    prompts = []
    for p in range(3):
        which = rng.sample(range(4), p + 1)
        ids, mm = [], []
        for k, im in enumerate(which):
            ids += [rng.randrange(0, 256) for _ in range(rng.randint(0, 5))] + [VISION_START]
            n = int(np.prod(images[im]["grid"])) // 4
            ids += [IMAGE_TOKEN] * n + [VISION_END]
            mm.append(im)
        ids += [rng.randrange(0, 256) for _ in range(rng.randint(1, 6))]
        pv = torch.cat([ref[f"pixel_values_pil_{i}"] for i in which])
        grid = torch.tensor([images[i]["grid"] for i in which])
        inp = torch.tensor([ids])
        types = (inp == IMAGE_TOKEN).int()
        with torch.no_grad():
            out = model(input_ids=inp, pixel_values=pv, image_grid_thw=grid, mm_token_type_ids=types)
            ref[f"logits_{p}"] = out.logits[0].float().contiguous()
            gen = model.generate(
                input_ids=inp,
                pixel_values=pv,
                image_grid_thw=grid,
                mm_token_type_ids=types,
                attention_mask=torch.ones_like(inp),
                max_new_tokens=8,
                do_sample=False,
            )
        ref[f"greedy_{p}"] = gen[0, len(ids):].to(torch.int64).contiguous()
        prompts.append({"ids": ids, "images": mm})
    # Chats through the processor: the template, each image's placeholder expanded.
    write_tokenizer(d)
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(d)
    chats = [
        [{"role": "user", "content": [{"type": "image", "image": 0}, {"type": "text", "text": "What is this?"}]}],
        [
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": [
                {"type": "text", "text": "Compare "}, {"type": "image", "image": 1},
                {"type": "text", "text": " and "}, {"type": "image", "image": 2}]},
            {"role": "assistant", "content": "They differ."},
            {"role": "user", "content": [{"type": "image", "image": 3}, {"type": "text", "text": "And this one?"}]},
        ],
    ]
    chat_cases = []
    for c, chat in enumerate(chats):
        text = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        which = [part["image"] for m in chat if isinstance(m["content"], list)
                 for part in m["content"] if part["type"] == "image"]
        imgs = [Image.open(d / "images" / f"{i}.png") for i in which]
        px = pil(images=imgs, return_tensors="pt")
        # The processor's rule: each <|image_pad|> becomes grid product / merge² of them.
        parts = text.split("<|image_pad|>")
        expanded = parts[0]
        for k, g in enumerate(px["image_grid_thw"]):
            expanded += "<|image_pad|>" * (int(g.prod()) // 4) + parts[k + 1]
        ids = tok(expanded)["input_ids"]
        inp = torch.tensor([ids])
        with torch.no_grad():
            gen = model.generate(input_ids=inp, pixel_values=px["pixel_values"], image_grid_thw=px["image_grid_thw"],
                                 mm_token_type_ids=(inp == IMAGE_TOKEN).int(), attention_mask=torch.ones_like(inp),
                                 max_new_tokens=8, do_sample=False)
        greedy = gen[0, len(ids):].tolist()
        chat_cases.append({"messages": chat, "ids": ids, "greedy": greedy,
                           "text": tok.decode(greedy, skip_special_tokens=True)})
    save_file(ref, d / "reference.safetensors")
    (d / "cases.json").write_text(
        json.dumps({"images": images, "prompts": prompts, "chats": chat_cases, "image_token_id": IMAGE_TOKEN},
                   indent=1)
    )
    if hub_names:
        # The hub's files keep the language model's fields at the top level and name
        # M-RoPE as a scaling type.
        c = json.loads((d / "config.json").read_text())
        text = c.pop("text_config")
        rope = text.pop("rope_parameters")
        c.update({k: v for k, v in text.items() if k not in ("model_type",)})
        c["rope_theta"] = rope["rope_theta"]
        c["rope_scaling"] = {"type": "mrope", "mrope_section": rope["mrope_section"]}
        (d / "config.json").write_text(json.dumps(c, indent=2))
    (d / "generation_config.json").unlink(missing_ok=True)
    print(name, "text", cfg.text_config.num_hidden_layers, "layers, mrope", mrope, "vision depth", depth,
          "window", cfg.vision_config.window_size, "full", cfg.vision_config.fullatt_block_indexes,
          "images", [im["grid"] for im in images])


if __name__ == "__main__":
    torch.set_num_threads(2)
    for name, seed, hub in [("a", 6401, False), ("b", 6402, True), ("c", 6403, False)]:
        make_case(name, seed, hub)
