#!/usr/bin/env python3
"""The tiny GGUF goldens for troupe's Rust tests (part of `make_goldens.py`, which runs
it as `--only gguf`): the tiny HF checkpoints written as GGUF files by gguf-py, plain and
Q8_0, with transformers' logits for the checkpoints they came from, checked on the way
against gguf-py's own reading of them.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from make_goldens import OUT, REPO, logit_cases, write_json

GGUF_PRE = {"llama": "llama-bpe", "qwen2": "qwen2"}


def llama_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf LlamaModel.permute: HF's rotate-half q/k rows -> GGML's interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama_unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_factors(hp: dict, rope: dict, torch):
    """LlamaModel.generate_extra_tensors: per-frequency divisors of inv_freq (rope_freqs.weight).

    One deliberate difference: llama.cpp reads `original_max_position_embeddings` from the
    top level of config.json (default 8192), where it never is for Llama-3.x; transformers
    reads it from rope_scaling. Real Llama-3 checkpoints use 8192 so both agree there, but
    tiny-llama uses 64, so the value is taken from rope_scaling as transformers does."""
    import math

    base = rope["rope_theta"]
    dim = hp.get("head_dim") or hp["hidden_size"] // hp["num_attention_heads"]
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor = rope.get("factor", 8.0)
    low_freq_factor = rope.get("low_freq_factor", 1.0)
    high_freq_factor = rope.get("high_freq_factor", 4.0)
    old_context_len = rope.get("original_max_position_embeddings", hp.get("original_max_position_embeddings", 8192))
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    assert low_freq_wavelen != high_freq_wavelen
    rope_factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            rope_factors.append(1.0)
        elif wavelen > low_freq_wavelen:
            rope_factors.append(factor)
        else:
            smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            rope_factors.append(float(1 / ((1 - smooth) / factor + smooth)))
    return np.array(rope_factors, dtype=np.float32)


def write_tiny_gguf(arch: str, path: Path, qtype=None, src: Path | None = None, quantize=None) -> None:
    """Convert tests/goldens/tiny-{arch} (or `src`) to GGUF like `convert_hf_to_gguf.py
    --outtype f32` (qtype None) or `--outtype q8_0` (qtype Q8_0: 2-D weights quantized, 1-D
    kept F32). `quantize(name, data) -> (bytes, type)`, where given, quantizes each 2-D
    tensor instead (the K-quants, through ggml's own quantizer)."""
    import gguf
    import torch
    from gguf import GGMLQuantizationType as T
    from safetensors import safe_open
    from transformers import AutoConfig, AutoTokenizer

    d = src or OUT / f"tiny-{arch}"
    hp = AutoConfig.from_pretrained(d).to_dict()  # what convert_hf_to_gguf's load_hparams does
    rope = hp.get("rope_parameters") or hp.get("rope_scaling") or {}
    n_head, n_kv = hp["num_attention_heads"], hp["num_key_value_heads"]
    n_layer = hp["num_hidden_layers"]
    model_arch = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2}[arch]

    w = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[model_arch])
    ftype = gguf.LlamaFileType.MOSTLY_Q8_0 if qtype == T.Q8_0 else gguf.LlamaFileType.ALL_F32

    # ModelBase.prepare_metadata / TextModel.set_gguf_parameters (+ LlamaModel extras)
    w.add_type(gguf.GGUFType.MODEL)
    w.add_name(path.stem)
    w.add_block_count(n_layer)
    w.add_context_length(hp["max_position_embeddings"])
    w.add_embedding_length(hp["hidden_size"])
    w.add_feed_forward_length(hp["intermediate_size"])
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    w.add_file_type(ftype)
    if arch == "llama":
        w.add_vocab_size(hp["vocab_size"])
        w.add_rope_dimension_count(hp.get("head_dim") or hp["hidden_size"] // n_head)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)

    # TextModel._set_vocab_gpt2 / get_vocab_base. The real converter picks tokenizer.ggml.pre
    # by hashing the tokenization of a fixed text; our tiny vocabularies match no known hash,
    # so the pre-tokenizer name is set to the one whose split regex the tokenizer.json uses.
    tok = AutoTokenizer.from_pretrained(d)
    vocab_size = hp["vocab_size"]
    reverse_vocab = {i: t for t, i in tok.vocab.items()}
    added_vocab = tok.get_added_vocab()
    added_decoder = tok.added_tokens_decoder
    tokens, toktypes = [], []
    for i in range(vocab_size):
        if i not in reverse_vocab:
            tokens.append(f"[PAD{i}]")
            toktypes.append(gguf.TokenType.UNUSED)
            continue
        t = reverse_vocab[i]
        if t in added_vocab:
            toktypes.append(gguf.TokenType.CONTROL if added_decoder[i].special else gguf.TokenType.USER_DEFINED)
        else:
            toktypes.append(gguf.TokenType.NORMAL)
        tokens.append(t)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(GGUF_PRE[arch])
    w.add_token_list(tokens)
    w.add_token_types(toktypes)
    # merges (list-of-pairs form joined with a space), bos/eos/pad ids, add_bos/add_eos
    # from tokenizer_config.json and the chat template: the converter's own helper.
    gguf.SpecialVocab(d, load_merges=True, n_vocab=len(tokens)).add_to_gguf(w, quiet=True)

    # Tensors: generated ones first, then the checkpoint's in file order (ModelBase.prepare_tensors).
    tensors: list[tuple[str, np.ndarray]] = []
    if rope.get("rope_type") == "llama3":
        tensors.append(("rope_freqs.weight", llama3_rope_factors(hp, rope, torch)))
    index = d / "model.safetensors.index.json"
    parts = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    tmap = gguf.get_tensor_name_map(model_arch, n_layer)
    for part in parts:
        with safe_open(str(d / part), "np") as st:
            for name in st.keys():
                data = st.get_tensor(name).astype(np.float32)
                if arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
                    data = llama_permute(data, n_head)
                elif arch == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
                    data = llama_permute(data, n_kv)
                new_name = tmap.get_name(name, try_suffixes=(".weight", ".bias"))
                assert new_name is not None, name
                tensors.append((new_name, data))
    for name, data in tensors:
        if quantize is not None and data.ndim >= 2:
            raw, t = quantize(name, data)
            w.add_tensor(name, raw, raw_dtype=t)
        elif qtype is not None and data.ndim >= 2:
            w.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, np.ascontiguousarray(data, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(f"  wrote {path.relative_to(REPO)} ({path.stat().st_size} bytes, {len(tensors)} tensors)")


def gguf_hf_state_dict(path: Path, arch: str, hp: dict) -> dict:
    """Read a GGUF written above back with GGUFReader: dequantize and undo the llama q/k
    permutation, keyed by the HF parameter names of the tiny checkpoint."""
    import gguf
    from gguf.quants import dequantize

    reader = gguf.GGUFReader(str(path))
    model_arch = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2}[arch]
    tmap = gguf.get_tensor_name_map(model_arch, hp["num_hidden_layers"])
    hf_names = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    for i in range(hp["num_hidden_layers"]):
        for sub in ("input_layernorm", "post_attention_layernorm"):
            hf_names.append(f"model.layers.{i}.{sub}.weight")
        for p in ("q", "k", "v", "o"):
            hf_names += [f"model.layers.{i}.self_attn.{p}_proj.weight", f"model.layers.{i}.self_attn.{p}_proj.bias"]
        for p in ("gate", "up", "down"):
            hf_names.append(f"model.layers.{i}.mlp.{p}_proj.weight")
    to_hf = {tmap.get_name(n, try_suffixes=(".weight", ".bias")): n for n in hf_names}
    out = {}
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":
            continue
        shape = [int(x) for x in reversed(t.shape.tolist())]  # GGUF ne is innermost-first
        data = np.array(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)  # writable copy
        name = to_hf[t.name]
        if arch == "llama" and ".q_proj." in name:
            data = llama_unpermute(data, hp["num_attention_heads"])
        elif arch == "llama" and ".k_proj." in name:
            data = llama_unpermute(data, hp["num_key_value_heads"])
        out[name] = data
    return out


def max_rel_err(got, want) -> float:
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


def check_tiny_gguf(arch: str, fname: str, ref: dict) -> None:
    """Diagnostics: read the file back with GGUFReader and, independently, with
    transformers' GGUF loader (weights + tokenizer), and compare with `ref`."""
    import gguf
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path = OUT / fname
    d = OUT / f"tiny-{arch}"
    hp = AutoConfig.from_pretrained(d).to_dict()
    reader = gguf.GGUFReader(str(path))
    types = sorted({t.tensor_type.name for t in reader.tensors})
    assert reader.fields["general.architecture"].contents() == arch
    assert reader.fields["tokenizer.ggml.tokens"].contents() == [
        t for t, _ in sorted(AutoTokenizer.from_pretrained(d).vocab.items(), key=lambda kv: kv[1])
    ]

    # GGUFReader round trip: for the F32 files, bit-identical to the safetensors checkpoint.
    sd = gguf_hf_state_dict(path, arch, hp)
    if "Q8_0" not in types:
        hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).state_dict()
        for name, data in sd.items():
            assert np.array_equal(data, hf[name].numpy()), name

    # transformers' GGUF loader ignores rope_freqs.weight (it knows no llama3 scaling from
    # GGUF metadata), so for llama its default inv_freq is divided by the file's factors here:
    # that is exactly how the engine is meant to use the tensor.
    model = AutoModelForCausalLM.from_pretrained(str(OUT), gguf_file=fname, dtype=torch.float32)
    model.eval()
    rf = {t.name: np.array(t.data, dtype=np.float32) for t in reader.tensors}.get("rope_freqs.weight")
    if rf is not None:
        with torch.no_grad():
            raw = max(
                max_rel_err(model(torch.tensor([c["prompt_ids"]])).logits[0, -1].numpy(), c["last_logits"])
                for c in ref["cases"]
            )
        print(f"  {fname}: as transformers loads it (rope_freqs ignored): max rel logit err {raw:.2e}")
        rot = model.model.rotary_emb
        hf_inv = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).model.rotary_emb.inv_freq
        new_inv = rot.inv_freq / torch.from_numpy(rf)
        print(f"  {fname}: default inv_freq / rope_freqs vs HF llama3 inv_freq: max rel err "
              f"{max_rel_err(new_inv.numpy(), hf_inv.numpy()):.2e}")
        rot.inv_freq.copy_(new_inv)
        rot.original_inv_freq.copy_(new_inv)
    errs, greedy_ok = [], 0
    for c in ref["cases"]:
        with torch.no_grad():
            last = model(torch.tensor([c["prompt_ids"]])).logits[0, -1].float().numpy()
        errs.append(max_rel_err(last, c["last_logits"]))
        greedy_ok += int(np.argmax(last)) == c["greedy"][0]
    print(f"  {fname}: tensor types {types}; transformers GGUF load vs reference: "
          f"max rel logit err {max(errs):.2e}, first greedy token {greedy_ok}/{len(ref['cases'])}")

    if "text_cases" in ref:
        gtok = AutoTokenizer.from_pretrained(str(OUT), gguf_file=fname)
        bad = [c["text"] for c in ref["text_cases"] if gtok.encode(c["text"], add_special_tokens=False) != c["ids"]]
        n = len(ref["text_cases"])
        print(f"  {fname}: transformers GGUF tokenizer vs tokenizer.json: {n - len(bad)}/{n} agree; differ: {bad!r}")


def make_tiny_gguf():
    import torch
    from gguf import GGMLQuantizationType as T
    from transformers import AutoConfig, AutoModelForCausalLM

    for arch in ("llama", "qwen2"):
        write_tiny_gguf(arch, OUT / f"tiny-{arch}.gguf")
    # Each legacy block format gguf-py can quantize (K-quants and IQ4 have no quantizer
    # there, and need rows of 256: tiny-llama's are 64 wide).
    quantized = {"tiny-llama-q8": T.Q8_0, "tiny-llama-q4_0": T.Q4_0, "tiny-llama-q4_1": T.Q4_1,
                 "tiny-llama-q5_0": T.Q5_0, "tiny-llama-q5_1": T.Q5_1}
    d = OUT / "tiny-llama"
    hp = AutoConfig.from_pretrained(d).to_dict()
    ref = json.loads((d / "reference.json").read_text())
    for name, qtype in quantized.items():
        write_tiny_gguf("llama", OUT / f"{name}.gguf", qtype=qtype)
        # Reference: the HF model with its weights replaced by the values the file
        # dequantizes to (read back with GGUFReader + gguf-py's dequantize).
        model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
        model.eval()
        sd = gguf_hf_state_dict(OUT / f"{name}.gguf", "llama", hp)
        assert set(sd) == set(model.state_dict()), set(sd) ^ set(model.state_dict())
        model.load_state_dict({k: torch.from_numpy(v) for k, v in sd.items()}, strict=True)
        cases = logit_cases(model, torch, [c["prompt_ids"] for c in ref["cases"]])
        for c, r in zip(cases, ref["cases"]):
            print(f"  {name} len {len(c['prompt_ids'])}: greedy {c['greedy']} "
                  f"(f32 {'same' if c['greedy'] == r['greedy'] else 'differs'}), "
                  f"logits vs f32 max rel diff {max_rel_err(c['last_logits'], r['last_logits']):.2e}")
        write_json(OUT / f"{name}.reference.json", {"cases": cases})
        if qtype == T.Q8_0:
            # transformers' own GGUF reader agrees with gguf-py's on Q8_0 only; the
            # references above come from gguf-py's dequantization for every format.
            check_tiny_gguf("llama", f"{name}.gguf", {"cases": cases})

    for arch in ("llama", "qwen2"):
        check_tiny_gguf(arch, f"tiny-{arch}.gguf", json.loads((OUT / f"tiny-{arch}" / "reference.json").read_text()))


# ---------------------------------------------------------------------------
