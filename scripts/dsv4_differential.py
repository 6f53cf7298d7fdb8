#!/usr/bin/env python3
"""Randomized differential cases for DeepSeek-V4: random `DeepseekV4Config`s, random weights,
random prompts, and transformers' fp32 outputs for each, for `tests/deepseek_v4_differential.rs`.

Each case is a directory: `config.json` + `model.safetensors` (transformers' `save_pretrained`,
in bf16 or fp32), `case.json` (the knobs drawn, the prompt, the greedy continuation) and
`logits.safetensors` (f32 logits of every position of prompt + continuation, from
transformers' cached path fed one token at a time: see `step_by_step`).

Every knob of the config is drawn: sliding window, both compress rates (above, at and below
the window), indexer heads / head dim / top-k, mHC streams and Sinkhorn iterations, head
dim and partial rotary, YaRN on the compressed branch, q/o LoRA ranks and o_groups, expert
counts / top-k / scoring function / routed scaling / normalisation, the SwiGLU limit,
hash-MoE layers. Weights are drawn at realistic scales (initializer ranges 0.02-0.4, norm
weights around 1), and the constants transformers initialises to fixed values (sinks,
position biases, mHC bases and scales, router biases, the hash table) are drawn too.

A prompt is redrawn while one of transformers' own decisions sits on a near-tie that is
not an exact tie (the indexer's k-th against (k+1)-th score, the router's k-th against
(k+1)-th expert score, the greedy top-2 logits within 1e-4 of each other): those flip under
any change of summation order. Exact ties (an indexer score of exactly 0 shared by several
entries, which ReLU makes common with few indexer heads) are kept: they must resolve as
torch's `topk` resolves them.

Usage (transformers pinned in scripts/requirements-goldens.txt):
    python3 scripts/dsv4_differential.py --out /tmp/dsv4-cases --cases 200 --seed 1
    TROUPE_DSV4_CASES=/tmp/dsv4-cases cargo test --release --test deepseek_v4_differential
    python3 scripts/dsv4_differential.py --goldens   # the small committed subset
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import tempfile
from pathlib import Path

import torch
import transformers

transformers.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()

from safetensors.torch import save_file
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM, DynamicCache

from make_dsv4_goldens import draw_mtp_glue, randomize_constants

REPO = Path(__file__).resolve().parent.parent
GOLDENS = REPO / "tests" / "goldens" / "dsv4-diff"
# Committed cases: small enough to keep the repository light (vocab, width, prompt length).
GOLDEN_SEEDS = range(1000, 1010)

NEAR_TIE = 2e-5


def draw_config(rng: random.Random, small: bool) -> dict:
    """One random config; `small` keeps the tensors (and the committed files) small."""
    heads = rng.choice([1, 2, 4, 8])
    head_dim = rng.choice([16, 32] if small else [16, 32, 48, 64])
    prf = rng.choice([f for f in (0.125, 0.25, 0.5, 1.0) if int(head_dim * f) % 2 == 0 and head_dim * f >= 2])
    rope_dim = int(head_dim * prf)
    window = rng.choice([2, 3, 4, 6, 8, 12, 16, 24, 32])
    csa = rng.choice([2, 4, 8])
    hca = rng.choice([r for r in (4, 8, 16, 32, 64) if r != csa] + [2 * window if 2 * window <= 64 else 64])
    layers = rng.randint(2, 4 if small else 7)
    kinds = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"]
    layer_types = [rng.choice(kinds) for _ in range(layers)]
    # Every case exercises compression.
    if not any(t != "sliding_attention" for t in layer_types):
        layer_types[rng.randrange(layers)] = rng.choice(kinds[1:])
    n_hash = rng.randint(0, min(2, layers))
    experts = rng.choice([2, 4, 8, 16] if not small else [2, 4, 8])
    topk = rng.randint(1, min(4, experts))
    o_groups = rng.choice([g for g in (1, 2, 4) if heads % g == 0])
    index_head_dim = rng.choice([d for d in (8, 16, 24, 32) if d >= rope_dim] or [rope_dim])
    cfg = dict(
        vocab_size=rng.choice([64, 128] if small else [128, 256, 512]),
        hidden_size=rng.choice([32, 48] if small else [32, 64, 96]),
        moe_intermediate_size=rng.choice([8, 16, 32]),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        head_dim=head_dim,
        q_lora_rank=rng.choice([8, 16, 32]),
        num_experts_per_tok=topk,
        n_routed_experts=experts,
        n_shared_experts=1,
        layer_types=layer_types,
        mlp_layer_types=["hash_moe"] * n_hash + ["moe"] * (layers - n_hash),
        compress_rates={"compressed_sparse_attention": csa, "heavily_compressed_attention": hca},
        hc_mult=rng.choice([1, 2, 3, 4]),
        hc_sinkhorn_iters=rng.randint(1, 20),
        sliding_window=window,
        o_groups=o_groups,
        o_lora_rank=rng.choice([4, 8, 16]),
        index_n_heads=rng.choice([1, 2, 4, 8, 16]),
        index_head_dim=index_head_dim,
        index_topk=rng.randint(1, 8),
        partial_rotary_factor=prf,
        scoring_func=rng.choice(["sqrtsoftplus", "sigmoid"]),
        norm_topk_prob=rng.random() < 0.8,
        routed_scaling_factor=round(rng.uniform(0.5, 3.0), 3),
        swiglu_limit=round(rng.choice([rng.uniform(0.3, 2.0), 10.0]), 3),
        initializer_range=round(math.exp(rng.uniform(math.log(0.02), math.log(0.4))), 4),
        max_position_embeddings=1024,
        rope_theta=rng.choice([10000.0, 500.0]),
        compress_rope_theta=rng.choice([160000.0, 1000.0]),
    )
    if rng.random() < 0.5:
        cfg["rope_parameters"] = {
            "rope_type": "yarn",
            "factor": rng.choice([2.0, 4.0, 16.0]),
            "original_max_position_embeddings": rng.choice([16, 32, 64]),
        }
    return cfg


class NearTies:
    """While active, the smallest relative gap between a kept and a dropped candidate of
    the indexer's and the routers' top-k in every forward, exact ties aside. Fed one
    token at a time, a query's indexer scores are exactly the entries emitted so far."""

    def __init__(self, model: DeepseekV4ForCausalLM, cfg: DeepseekV4Config):
        self.smallest = float("inf")
        self.model, self.cfg, self.handles = model, cfg, []

    def gap(self, sorted_vals: torch.Tensor, k: int) -> None:
        """Relative to the row's largest magnitude: a score of -1e-9 beside exact zeros
        is a near-tie (another summation order makes it 0), however far apart relative to
        each other."""
        a, b = float(sorted_vals[k - 1]), float(sorted_vals[k])
        if a != b and math.isfinite(b):
            finite = sorted_vals[torch.isfinite(sorted_vals)]
            scale = max(float(finite.abs().max()), 1e-30)
            self.smallest = min(self.smallest, (a - b) / scale)

    def __enter__(self) -> "NearTies":
        cfg = self.cfg

        def indexer_hook(module, args, out):
            if out.numel() == 0:
                return
            k = module._k
            for row in out.reshape(-1, out.shape[-1]):
                if row.shape[0] <= k:
                    continue
                ordered = torch.sort(row, descending=True).values
                self.gap(ordered, k)
                if ordered[k - 1] == ordered[k]:
                    # An exact tie across the k-th place goes where introselect's partitions
                    # leave it, and those compare every value of the row: two values anywhere
                    # in it that another summation order could swap change which tied entry
                    # is kept.
                    distinct = torch.unique(ordered[torch.isfinite(ordered)])
                    for i in range(1, distinct.shape[0]):
                        self.gap(distinct.flip(0), i)

        def router_hook(module, args, out):  # also hooked on an MTP block (`add_mtp`)
            hidden = args[0].reshape(-1, args[0].shape[-1])
            logits = torch.nn.functional.linear(hidden.float(), module.weight.float())
            if cfg.scoring_func == "sigmoid":
                scores = logits.sigmoid()
            else:
                scores = torch.nn.functional.softplus(logits).sqrt()
            scores = scores + module.e_score_correction_bias
            k = cfg.num_experts_per_tok
            if k < scores.shape[-1]:
                for row in scores:
                    self.gap(torch.sort(row, descending=True).values, k)

        self.router_hook = router_hook
        for layer in self.model.model.layers:
            comp = layer.self_attn.compressor
            if comp is not None and hasattr(comp, "indexer"):
                scorer = comp.indexer.scorer
                scorer._k = comp.indexer.index_topk
                self.handles.append(scorer.register_forward_hook(indexer_hook))
            gate = layer.mlp.gate
            if hasattr(gate, "e_score_correction_bias"):
                self.handles.append(gate.register_forward_hook(router_hook))
        return self

    def __exit__(self, *exc) -> None:
        for h in self.handles:
            h.remove()


def step_by_step(model: DeepseekV4ForCausalLM, prompt: torch.Tensor, new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """The prompt fed one token at a time through transformers' own V4 cache, then greedy
    decoding: the greedy tokens and the logits of every position of prompt + continuation.

    This is the reference rather than one uncached forward because the indexer's `topk`
    breaks exact ties differently with the row's length: uncached, a query also scores
    the masked entries of the sequence's future, so its choice among tied entries depends
    on how long the whole sequence is. Token by token, each query scores exactly the
    entries emitted so far, as a causal engine must."""
    cache = DynamicCache(config=model.config)
    rows, tokens, streams = [], [], []
    handle = model.model.layers[-1].register_forward_hook(lambda m, a, o: streams.append(o[0, -1]))
    seq = prompt.tolist()
    with torch.no_grad():
        for i in range(len(seq) + new_tokens - 1):
            ids = torch.tensor([[seq[i]]])
            logits = model(input_ids=ids, cache=cache, use_cache=True).logits[0, -1].float()
            rows.append(logits)
            if i >= len(seq) - 1:
                nxt = int(logits.argmax())
                tokens.append(nxt)
                seq.append(nxt)
    handle.remove()
    model._last_streams = torch.stack(streams).unsqueeze(0)  # [1, n, hc, d]
    return tokens, torch.stack(rows).contiguous()


def add_mtp(out: Path, params: dict, model: DeepseekV4ForCausalLM, seq: torch.Tensor, gen: torch.Generator, bf16: bool, ties: "NearTies") -> torch.Tensor:
    """Gives the checkpoint a random MTP layer (`mtp.0.*`, DeepSeek's names) and returns its
    teacher-forced logits at positions 0..n-2 of `seq`. transformers drops `mtp.*` on load, so
    the reference is composed as in scripts/make_dsv4_goldens.py: transformers' own decoder
    layer (an extra sliding-window, score-routed layer of the config) inside DeepSeek's
    `MTPBlock` glue, over the main model's last streams from the step-by-step run."""
    from safetensors.torch import load_file
    from transformers.masking_utils import create_sliding_window_causal_mask

    layers = params["num_hidden_layers"]
    big_params = dict(params)
    big_params.update(
        num_hidden_layers=layers + 1,
        layer_types=params["layer_types"] + ["sliding_attention"],
        mlp_layer_types=params["mlp_layer_types"] + ["moe"],
    )
    big_cfg = DeepseekV4Config(**big_params)
    big_cfg._attn_implementation = "eager"
    big = DeepseekV4ForCausalLM(big_cfg).float().eval()
    randomize_constants(big, big_cfg, gen, bf16)
    dtype = torch.bfloat16 if bf16 else torch.float32
    with tempfile.TemporaryDirectory() as tmp:
        big.to(dtype).save_pretrained(tmp, safe_serialization=True)
        saved = load_file(str(Path(tmp) / "model.safetensors"))
    big.float()
    block = big.model.layers[layers]
    prefix = f"model.layers.{layers}."
    mtp = {"mtp.0." + k[len(prefix):]: v for k, v in saved.items() if k.startswith(prefix)}
    e_proj, h_proj, enorm, hnorm, norm, head, glue = draw_mtp_glue(big_cfg, gen, bf16)
    mtp.update({k: v.to(dtype) for k, v in glue.items()})
    tensors = load_file(str(out / "model.safetensors"))
    tensors.update(mtp)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})

    gate = block.mlp.gate
    router = ties.router_hook
    handle = gate.register_forward_hook(router)
    with torch.no_grad():
        h = model._last_streams[:, : seq.shape[0] - 1]
        next_ids = seq[1:]
        e = enorm(model.model.embed_tokens(next_ids.unsqueeze(0)))
        x = torch.nn.functional.linear(e, e_proj).unsqueeze(2) + torch.nn.functional.linear(hnorm(h), h_proj)
        pos = torch.arange(next_ids.shape[0]).unsqueeze(0)
        rotary = model.model.rotary_emb
        pe = {
            "main": rotary(e, position_ids=pos, layer_type="main"),
            "compress": rotary(e, position_ids=pos, layer_type="compress"),
        }
        mask = create_sliding_window_causal_mask(config=big_cfg, inputs_embeds=e, attention_mask=None, cache=None, position_ids=pos)
        y = block(x, position_embeddings=pe, position_ids=pos, attention_mask=mask, input_ids=next_ids.unsqueeze(0), cache=None)
        logits = model.lm_head(norm(head(y)))[0].float().contiguous()
    handle.remove()
    return logits


def make_case(seed: int, out: Path, small: bool, max_prompt: int, new_tokens: int, min_prompt: int = 1) -> dict:
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    params = draw_config(rng, small)
    bf16 = rng.random() < 0.5
    cfg = DeepseekV4Config(**params)
    cfg._attn_implementation = "eager"
    model = DeepseekV4ForCausalLM(cfg).float().eval()
    randomize_constants(model, cfg, gen, bf16)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    model.to(torch.bfloat16 if bf16 else torch.float32).save_pretrained(out, safe_serialization=True)
    (out / "generation_config.json").unlink(missing_ok=True)
    # The reference is the model read back from the file (a reader recomputes the rotary).
    model = DeepseekV4ForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    model.config._attn_implementation = "eager"

    # Prompt lengths: half log-uniform (short prompts and every early boundary), half
    # uniform (long ones) over min_prompt..max_prompt.
    for attempt in range(40):
        if rng.random() < 0.5:
            n = int(round(math.exp(rng.uniform(math.log(min_prompt), math.log(max_prompt)))))
        else:
            n = rng.randint(min_prompt, max_prompt)
        prompt = torch.randint(2, cfg.vocab_size, (n,), generator=gen)
        with NearTies(model, cfg) as ties:
            tokens, logits = step_by_step(model, prompt, new_tokens)
        seq = torch.cat([prompt, torch.tensor(tokens[:-1], dtype=prompt.dtype)])
        with torch.no_grad():
            uncached = model(seq.unsqueeze(0), use_cache=False).logits[0].float()
        top2 = torch.topk(logits[n - 1 :], 2).values
        margin = float(((top2[:, 0] - top2[:, 1]) / top2[:, 0].abs().clamp_min(1e-30)).min())
        if margin > NEAR_TIE and ties.smallest > NEAR_TIE:
            break
    else:
        raise SystemExit(f"seed {seed}: every prompt drawn sits on a near-tie")

    with_mtp = rng.random() < 0.5
    tensors = {"logits": logits}
    if with_mtp:
        ties.smallest = float("inf")
        tensors["mtp_logits"] = add_mtp(out, params, model, seq, gen, bf16, ties)
        if ties.smallest <= NEAR_TIE:
            # The MTP block's router sits on a near-tie: keep the case without its MTP.
            del tensors["mtp_logits"]
            with_mtp = False
    save_file(tensors, str(out / "logits.safetensors"))
    scale = logits.abs().amax(-1).clamp_min(1e-30)
    uncached_diff = float(((uncached - logits).abs().amax(-1) / scale).max())
    case = {
        "source": f"transformers {__import__('transformers').__version__} DeepseekV4ForCausalLM (f32, eager), "
        f"scripts/dsv4_differential.py, seed {seed}",
        "seed": seed,
        "weights": "bf16" if bf16 else "f32",
        "attempts": attempt + 1,
        # transformers' own uncached forward against this reference: above ~1e-5 only
        # where exact indexer ties resolve differently with the row's length.
        "uncached_max_rel_diff": uncached_diff,
        "prompt": prompt.tolist(),
        "greedy_tokens": tokens,
        "knobs": params,
        "mtp": with_mtp,
    }
    (out / "case.json").write_text(json.dumps(case, indent=1) + "\n")
    return case


def make_topk_ties() -> None:
    """Rows full of exact ties and torch's CPU `topk` of each (sorted and not), for both of
    ATen's paths (`partial_sort` when 64·k <= n, else `nth_element`)."""
    rng = random.Random(5)
    rows = []
    for i in range(400):
        n = rng.choice([1, 2, 3, 5, 8, 16, 17, 33, 64, 65, 100, 128, 200, 513])
        k = rng.randint(1, min(n, rng.choice([2, 8, 40])))
        levels = rng.choice([1, 2, 3, 5, 1000])
        values = [float(rng.randrange(levels)) * 0.5 for _ in range(n)]
        if rng.random() < 0.3:  # masked future entries, as the indexer's scores have
            cut = rng.randrange(n + 1)
            values = values[:cut] + [float("-inf")] * (n - cut)
        t = torch.tensor(values, dtype=torch.float32)
        rows.append(
            {
                "values": [v if math.isfinite(v) else "-inf" for v in values],
                "k": k,
                "sorted": torch.topk(t, k, sorted=True).indices.tolist(),
                "unsorted": torch.topk(t, k, sorted=False).indices.tolist(),
            }
        )
    out = REPO / "tests" / "goldens" / "torch_topk_ties.json"
    out.write_text(json.dumps({"source": f"torch {torch.__version__} CPU topk, scripts/dsv4_differential.py", "rows": rows}) + "\n")
    print(f"{out.name}: {len(rows)} rows")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, help="directory for the cases (one subdirectory each)")
    ap.add_argument("--cases", type=int, default=200)
    ap.add_argument("--seed", type=int, default=1, help="first case's seed; case i uses seed + i")
    ap.add_argument("--max-prompt", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--goldens", action="store_true", help="write the committed subset to tests/goldens/dsv4-diff")
    args = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    if args.goldens:
        make_topk_ties()
        if GOLDENS.exists():
            shutil.rmtree(GOLDENS)
        for seed in GOLDEN_SEEDS:
            case = make_case(seed, GOLDENS / f"case-{seed}", True, 160, 32, min_prompt=16)
            k = case["knobs"]
            print(
                f"golden {seed}: {len(case['prompt'])} prompt tokens, {case['weights']}, mtp {case['mtp']}, "
                f"index heads {k['index_n_heads']} top-{k['index_topk']}, layers {k['layer_types']}"
            )
        return
    if args.out is None:
        ap.error("--out or --goldens")
    for i in range(args.cases):
        seed = args.seed + i
        case = make_case(seed, args.out / f"case-{seed}", False, args.max_prompt, args.new_tokens)
        k = case["knobs"]
        print(
            f"case {seed}: prompt {len(case['prompt'])}, {case['weights']}, layers {k['layer_types']}, "
            f"window {k['sliding_window']}, rates {k['compress_rates']}, topk {k['index_topk']}",
            flush=True,
        )


if __name__ == "__main__":
    main()
