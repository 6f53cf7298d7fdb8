#!/usr/bin/env python3
"""Write tiny random DeepSeek-V4 checkpoints and transformers' reference outputs for them.

Each checkpoint lands in tests/goldens/<name>/: `config.json` and `model.safetensors`
(transformers' `save_pretrained`, which writes DeepSeek's own tensor names; weights are
bf16-representable values stored as bf16, so the files stay small while both engines
compute in f32 on identical numbers), `reference.json` (prompts, greedy continuations)
and `reference.safetensors` (every position's f32 logits of each prompt).

The configs are shrunk so that short prompts cross every boundary that matters: a
sliding window of a few tokens, compress rates of 2-8, an indexer top-k smaller than the
number of compressed entries, hash-routed and score-routed MoE layers, several mHC
streams; checkpoint B adds YaRN on the compressed branches and sigmoid scoring.

Parameters transformers initialises to constants (attention sinks, compressor position
biases, mHC bases and scales, the router's correction bias, the hash table) are drawn at
random here: at their defaults a wrong formula would go unnoticed.

Usage:
    python3 -m pip install -r scripts/requirements-goldens.txt
    python3 scripts/make_dsv4_goldens.py
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

from safetensors.torch import load_file, save_file
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
from transformers.masking_utils import create_sliding_window_causal_mask
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HyperHead, DeepseekV4RMSNorm

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "tests" / "goldens"

CONFIGS = {
    "tiny-dsv4-a": dict(
        vocab_size=256,
        hidden_size=32,
        moe_intermediate_size=16,
        num_hidden_layers=5,
        num_attention_heads=4,
        head_dim=16,
        q_lora_rank=16,
        num_experts_per_tok=2,
        n_routed_experts=4,
        layer_types=[
            "sliding_attention",
            "compressed_sparse_attention",
            "heavily_compressed_attention",
            "compressed_sparse_attention",
            "sliding_attention",
        ],
        mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe", "moe"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        hc_mult=4,
        sliding_window=8,
        o_groups=2,
        o_lora_rank=8,
        index_n_heads=8,
        index_head_dim=16,
        index_topk=3,
        partial_rotary_factor=0.5,
        scoring_func="sqrtsoftplus",
        swiglu_limit=0.6,
        initializer_range=0.25,
    ),
    "tiny-dsv4-b": dict(
        vocab_size=200,
        hidden_size=32,
        moe_intermediate_size=16,
        num_hidden_layers=4,
        num_attention_heads=2,
        head_dim=16,
        q_lora_rank=8,
        num_experts_per_tok=3,
        n_routed_experts=6,
        layer_types=[
            "heavily_compressed_attention",
            "compressed_sparse_attention",
            "sliding_attention",
            "heavily_compressed_attention",
        ],
        mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
        compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 4},
        hc_mult=2,
        hc_sinkhorn_iters=7,
        sliding_window=6,
        o_groups=1,
        o_lora_rank=8,
        index_n_heads=8,
        index_head_dim=12,
        index_topk=4,
        partial_rotary_factor=0.5,
        scoring_func="sigmoid",
        routed_scaling_factor=2.5,
        swiglu_limit=0.5,
        rope_parameters={"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 16},
        max_position_embeddings=128,
        initializer_range=0.25,
    ),
}

PROMPT_LENGTHS = (72, 29)
GREEDY_PROMPT_LEN = 11
GREEDY_NEW_TOKENS = 24


def randomize_constants(model: DeepseekV4ForCausalLM, cfg: DeepseekV4Config, gen: torch.Generator, bf16: bool = True) -> None:
    """Draws the parameters transformers initialises to constants; with `bf16`, rounds every
    float weight to bf16 so a bf16 file and the f32 reference hold the same values."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("sinks", "position_bias")):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.7)
            elif name.endswith(("attn_hc.base", "ffn_hc.base", "hc_head.hc_base")):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
            elif name.endswith(("attn_hc.scale", "ffn_hc.scale", "hc_head.hc_scale")):
                p.copy_(0.5 + torch.rand(p.shape, generator=gen))
            elif "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
        for layer in model.model.layers:
            gate = layer.mlp.gate
            if hasattr(gate, "tid2eid"):
                table = torch.stack(
                    [torch.randperm(cfg.n_routed_experts, generator=gen)[: cfg.num_experts_per_tok] for _ in range(cfg.vocab_size)]
                )
                gate.tid2eid.copy_(table)
            else:
                gate.e_score_correction_bias.copy_(torch.randn(cfg.n_routed_experts, generator=gen) * 0.3)
        if not bf16:
            return
        # Round every float weight to bf16 so the stored file and the reference agree.
        for p in model.parameters():
            if p.dtype == torch.float32:
                p.copy_(p.bfloat16().float())
        for layer in model.model.layers:
            gate = layer.mlp.gate
            if hasattr(gate, "e_score_correction_bias"):
                gate.e_score_correction_bias.copy_(gate.e_score_correction_bias.bfloat16().float())


def indexer_margins(model: DeepseekV4ForCausalLM, ids: torch.Tensor) -> float:
    """Smallest gap between the k-th and (k+1)-th visible indexer score over all queries:
    a near-tie would make the top-k selection fragile to rounding."""
    smallest = [float("inf")]

    def hook(module, args, out):
        scores = out[0]  # [S, T]
        k = module_k[id(module)]
        rate = module_rate[id(module)]
        for t in range(scores.shape[0]):
            visible = (t + 1) // rate
            if visible > k:
                top = torch.sort(scores[t, :visible], descending=True).values
                smallest[0] = min(smallest[0], float(top[k - 1] - top[k]))

    module_k, module_rate, handles = {}, {}, []
    for layer in model.model.layers:
        comp = layer.self_attn.compressor
        if comp is not None and hasattr(comp, "indexer"):
            scorer = comp.indexer.scorer
            module_k[id(scorer)] = comp.indexer.index_topk
            module_rate[id(scorer)] = comp.indexer.compress_rate
            handles.append(scorer.register_forward_hook(hook))
    with torch.no_grad():
        model(ids.unsqueeze(0), use_cache=False)
    for h in handles:
        h.remove()
    return smallest[0]


def make(name: str, params: dict, seed: int, pack=None) -> None:
    """`pack`, where given, turns the saved f32 tensors (DeepSeek's names) into
    (the dequantized values the reference runs on, the tensors the checkpoint stores)."""
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    cfg = DeepseekV4Config(**params)
    cfg._attn_implementation = "eager"
    model = DeepseekV4ForCausalLM(cfg).float().eval()
    randomize_constants(model, cfg, gen)

    out = OUT / name
    out.mkdir(parents=True, exist_ok=True)
    stored = None
    if pack is None:
        model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    else:
        model.save_pretrained(out, safe_serialization=True)
        dequantized, stored = pack(load_file(str(out / "model.safetensors")))
        save_file(dequantized, str(out / "model.safetensors"), metadata={"format": "pt"})
    # The reference is the model read back from the file: the round trip through bf16 also
    # rounded the rotary buffers of the in-memory model, which a reader recomputes.
    reloaded = DeepseekV4ForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    if pack is None:
        for (n1, p1), (n2, p2) in zip(model.state_dict().items(), reloaded.state_dict().items()):
            assert n1 == n2 and torch.equal(p1.float(), p2.float()), f"{n1} changed through the file"
    else:
        save_file(stored, str(out / "model.safetensors"), metadata={"format": "pt"})
    model = reloaded
    (out / "generation_config.json").unlink(missing_ok=True)

    prompts = []
    for n in PROMPT_LENGTHS:
        # Draw again (deterministically) while a prompt's indexer top-k sits on a near-tie.
        for _ in range(50):
            ids = torch.randint(2, cfg.vocab_size, (n,), generator=gen)
            if indexer_margins(model, ids) > 1e-3:
                break
        else:
            raise SystemExit(f"{name}: every prompt drawn has an indexer near-tie")
        prompts.append(ids)
    logits = {}
    for i, ids in enumerate(prompts):
        with torch.no_grad():
            logits[f"prompt{i}"] = model(ids.unsqueeze(0), use_cache=False).logits[0].float().contiguous()
    save_file(logits, str(out / "reference.safetensors"))

    # Greedy continuation: full forwards without a cache, checked against generate() with
    # V4's own cache layers so both of transformers' paths agree before we trust them.
    greedy_prompt = torch.randint(2, cfg.vocab_size, (GREEDY_PROMPT_LEN,), generator=gen)
    seq = greedy_prompt.tolist()
    with torch.no_grad():
        for _ in range(GREEDY_NEW_TOKENS):
            seq.append(int(model(torch.tensor([seq]), use_cache=False).logits[0, -1].argmax()))
        cached = model.generate(
            greedy_prompt.unsqueeze(0),
            max_new_tokens=GREEDY_NEW_TOKENS,
            min_new_tokens=GREEDY_NEW_TOKENS,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0].tolist()
    assert cached == seq, f"{name}: generate() with a cache disagrees with full forwards"

    reference = {
        "source": f"transformers DeepseekV4ForCausalLM (f32, eager), scripts/make_dsv4_goldens.py, seed {seed}",
        "prompts": [p.tolist() for p in prompts],
        "logits": [f"prompt{i}" for i in range(len(prompts))],
        "greedy_prompt": greedy_prompt.tolist(),
        "greedy_tokens": seq[GREEDY_PROMPT_LEN:],
    }
    (out / "reference.json").write_text(json.dumps(reference, indent=1) + "\n")
    size = sum(f.stat().st_size for f in out.iterdir())
    print(f"{name}: {size / 1024:.0f} KiB, greedy {reference['greedy_tokens'][:8]}...")


def make_quantized_fixture() -> None:
    """FP8 and packed-FP4 weights with their scale grids, and transformers' own
    dequantization of each (`Fp8Dequantize`, what `from_pretrained(..., dequantize=True)`
    runs): 128x128-style FP8 blocks with f32 and E8M0 scales, MXFP4 experts with [1, 32]
    blocks of U8 exponents."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    gen = torch.Generator().manual_seed(3)
    dq = Fp8Dequantize(None)
    tensors = {}
    fp8 = (torch.randn(8, 16, generator=gen) * 3).to(torch.float8_e4m3fn)
    tensors["fp8.weight"] = fp8
    tensors["fp8.weight_scale_inv"] = torch.rand(2, 2, generator=gen) + 0.5
    fp8b = (torch.randn(8, 16, generator=gen) * 3).to(torch.float8_e4m3fn)
    tensors["fp8e8m0.weight"] = fp8b
    tensors["fp8e8m0.weight_scale_inv"] = (2.0 ** torch.randint(-3, 3, (2, 4), generator=gen).float()).to(torch.float8_e8m0fnu)
    tensors["fp4.weight"] = torch.randint(-128, 128, (4, 32), generator=gen, dtype=torch.int8)
    tensors["fp4.weight_scale_inv"] = torch.randint(120, 134, (4, 2), generator=gen, dtype=torch.uint8)
    for name in ("fp8", "fp8e8m0", "fp4"):
        tensors[f"{name}.expected"] = dq._dequantize_one(
            tensors[f"{name}.weight"], tensors[f"{name}.weight_scale_inv"], torch.float32
        ).contiguous()
    out = OUT / "quantized-weights.safetensors"
    save_file(tensors, str(out))
    print(f"{out.name}: {out.stat().st_size} bytes")


def draw_mtp_glue(cfg: DeepseekV4Config, gen: torch.Generator, bf16: bool = True):
    """DeepSeek's `MTPBlock` glue around the block, drawn at random (rounded to bf16 with
    `bf16`): `e_proj`, `h_proj`, the `enorm` / `hnorm` / `norm` RMS norms, the hyper-head,
    and the same as tensors by DeepSeek's names."""
    d, hc = cfg.hidden_size, cfg.hc_mult
    rnd = (lambda t: t.bfloat16().float()) if bf16 else (lambda t: t)
    e_proj = rnd(torch.randn(d, d, generator=gen) * d**-0.5)
    h_proj = rnd(torch.randn(d, d, generator=gen) * d**-0.5)
    enorm, hnorm, norm = (DeepseekV4RMSNorm(d, eps=cfg.rms_norm_eps) for _ in range(3))
    for n in (enorm, hnorm, norm):
        n.weight.data = rnd(1.0 + 0.2 * torch.randn(d, generator=gen))
    head = DeepseekV4HyperHead(cfg)
    head.hc_fn.data = rnd(torch.randn(hc, hc * d, generator=gen) * cfg.initializer_range)
    head.hc_base.data = rnd(torch.randn(hc, generator=gen) * 0.5)
    head.hc_scale.data = rnd(0.5 + torch.rand(1, generator=gen))
    glue = {
        "mtp.0.e_proj.weight": e_proj,
        "mtp.0.h_proj.weight": h_proj,
        "mtp.0.enorm.weight": enorm.weight.data,
        "mtp.0.hnorm.weight": hnorm.weight.data,
        "mtp.0.norm.weight": norm.weight.data,
        "mtp.0.hc_head_fn": head.hc_fn.data,
        "mtp.0.hc_head_base": head.hc_base.data,
        "mtp.0.hc_head_scale": head.hc_scale.data,
    }
    return e_proj, h_proj, enorm, hnorm, norm, head, glue


MTP_CHAIN_DRAFTS = 3


def add_mtp(name: str, seed: int) -> None:
    """Give checkpoint `name` an MTP layer (`mtp.0.*`, DeepSeek's names) and write its
    reference, `mtp_reference.{json,safetensors}`.

    transformers' `DeepseekV4ForCausalLM` drops `mtp.*` on load, so the reference is
    composed: the block is transformers' own `DeepseekV4DecoderLayer` (built as an extra
    sliding-window, score-routed layer of the same config), and the glue around it
    follows DeepSeek's `MTPBlock` (inference/model.py): `e = enorm(embed(next token))`,
    `x = e_proj(e) + h_proj(hnorm(h))` on every mHC stream of the main model's last
    streams `h`, the block, then the MTP's own hyper-head, its norm and the shared head.
    MTP position i reads the main model's streams at i and token i + 1 (RoPE position i).
    Drafts past the first feed the block's output streams back as `h` (vLLM's recursion)."""
    out = OUT / name
    main = DeepseekV4ForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    params = dict(CONFIGS[name])
    layers = params["num_hidden_layers"]
    params.update(
        num_hidden_layers=layers + 1,
        layer_types=params["layer_types"] + ["sliding_attention"],
        mlp_layer_types=params["mlp_layer_types"] + ["moe"],
    )
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    big_cfg = DeepseekV4Config(**params)
    big_cfg._attn_implementation = "eager"
    big = DeepseekV4ForCausalLM(big_cfg).float().eval()
    randomize_constants(big, big_cfg, gen)
    big.load_state_dict(main.state_dict(), strict=False)
    block = big.model.layers[layers]
    # DeepSeek's names for the block's tensors: what save_pretrained writes for layer L.
    with tempfile.TemporaryDirectory() as tmp:
        big.to(torch.bfloat16).save_pretrained(tmp, safe_serialization=True)
        saved = load_file(str(Path(tmp) / "model.safetensors"))
    big.float()
    prefix = f"model.layers.{layers}."
    mtp = {"mtp.0." + k[len(prefix):]: v for k, v in saved.items() if k.startswith(prefix)}

    e_proj, h_proj, enorm, hnorm, norm, head, glue = draw_mtp_glue(big_cfg, gen)
    mtp.update({k: v.bfloat16() for k, v in glue.items()})
    tensors = load_file(str(out / "model.safetensors"))
    tensors.update(mtp)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    again = DeepseekV4ForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    for (n1, p1), (n2, p2) in zip(main.state_dict().items(), again.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2), f"{n1} changed when the MTP layer was added"

    def streams_of(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The main model's last-layer streams `[1, n, hc, d]` and logits."""
        got = []
        handle = main.model.layers[-1].register_forward_hook(lambda m, a, o: got.append(o))
        logits = main(ids.unsqueeze(0), use_cache=False).logits[0]
        handle.remove()
        return got[0], logits

    def mtp_forward(h: torch.Tensor, next_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """MTP positions 0..n-1 of one sequence: `h` `[1, n, hc, d]`, `next_ids` `[n]`."""
        e = enorm(main.model.embed_tokens(next_ids.unsqueeze(0)))
        x = F.linear(e, e_proj).unsqueeze(2) + F.linear(hnorm(h), h_proj)
        pos = torch.arange(next_ids.shape[0]).unsqueeze(0)
        # The model read from the file: `big`'s rotary buffers went through bf16 above.
        rotary = main.model.rotary_emb
        pe = {
            "main": rotary(e, position_ids=pos, layer_type="main"),
            "compress": rotary(e, position_ids=pos, layer_type="compress"),
        }
        mask = create_sliding_window_causal_mask(
            config=big_cfg, inputs_embeds=e, attention_mask=None, cache=None, position_ids=pos
        )
        y = block(x, position_embeddings=pe, position_ids=pos, attention_mask=mask, input_ids=next_ids.unsqueeze(0), cache=None)
        return y, main.lm_head(norm(head(y)))[0]

    ref = json.loads((out / "reference.json").read_text())
    with torch.no_grad():
        # Teacher-forced: every position of prompt 0 with the true next token.
        ids = torch.tensor(ref["prompts"][0])
        h, _ = streams_of(ids)
        _, teacher = mtp_forward(h[:, :-1], ids[1:])
        # Drafting after the greedy prompt: the main model's next token, then the MTP's
        # own greedy drafts, each from the block's streams at the position before.
        ids = torch.tensor(ref["greedy_prompt"])
        h, logits = streams_of(ids)
        first = int(logits[-1].argmax())
        assert first == ref["greedy_tokens"][0]
        inputs_h, next_ids = h, torch.cat([ids[1:], torch.tensor([first])])
        drafts, chain = [], []
        for _ in range(MTP_CHAIN_DRAFTS):
            y, lg = mtp_forward(inputs_h, next_ids)
            chain.append(lg[-1])
            top = torch.topk(lg[-1], 2).values
            assert float(top[0] - top[1]) > 1e-3, "a draft sits on a near-tie"
            drafts.append(int(lg[-1].argmax()))
            inputs_h = torch.cat([inputs_h, y[:, -1:]], dim=1)
            next_ids = torch.cat([next_ids, torch.tensor([drafts[-1]])])
    save_file(
        {"teacher": teacher.contiguous(), "chain": torch.stack(chain).contiguous()},
        str(out / "mtp_reference.safetensors"),
    )
    (out / "mtp_reference.json").write_text(
        json.dumps(
            {
                "source": "transformers DeepseekV4DecoderLayer + DeepSeek's MTPBlock glue (f32, eager), "
                f"scripts/make_dsv4_goldens.py, seed {seed}",
                "teacher_prompt": "prompts[0]: logits of MTP positions 0..n-2",
                "chain_prompt": "greedy_prompt, then greedy_tokens[0]",
                "drafts": drafts,
            },
            indent=1,
        )
        + "\n"
    )
    print(f"{name}: MTP layer of {len(mtp)} tensors, drafts {drafts}")


def main() -> None:
    for seed, (name, params) in enumerate(CONFIGS.items()):
        make(name, params, seed + 7)
    add_mtp("tiny-dsv4-a", 11)
    make_quantized_fixture()


if __name__ == "__main__":
    main()
