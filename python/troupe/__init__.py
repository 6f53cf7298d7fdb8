"""troupe's offline API, shaped like vLLM's: `LLM(model, **engine_args)`, `.generate`,
`.chat`, `.generate_stream`, `SamplingParams`, prompts with `multi_modal_data` images, and
outputs with `.outputs[0].text`, `.token_ids` and `.logprobs`. The engine is the Rust one
(`troupe._troupe`)."""

from __future__ import annotations

import base64
import dataclasses
import io
import json
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Sequence, Union

from . import _troupe

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "DEFAULT_MODEL"]

DEFAULT_MODEL = "smollm2-135m-instruct"


@dataclass
class SamplingParams:
    """How to sample, as vLLM's `SamplingParams` (keyword arguments; an unknown one is a
    `TypeError`). `temperature=0` is greedy; `max_tokens=None` runs to the context's end."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: Optional[int] = None
    stop: Union[None, str, List[str]] = None
    stop_token_ids: Optional[List[int]] = None
    ignore_eos: bool = False
    max_tokens: Optional[int] = 16
    min_tokens: int = 0
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    skip_special_tokens: bool = True
    logit_bias: Optional[Dict[int, float]] = None

    def _wire(self) -> dict:
        d = dataclasses.asdict(self)
        d["stop"] = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        d["stop_token_ids"] = list(self.stop_token_ids or [])
        d["logit_bias"] = [[int(k), float(v)] for k, v in (self.logit_bias or {}).items()]
        return d


@dataclass
class Logprob:
    """A token's log-probability, its rank among the most likely (1 = the likeliest;
    `None` when it is not among the reported ones) and its text."""

    logprob: float
    rank: Optional[int]
    decoded_token: str


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: List[int]
    cumulative_logprob: Optional[float]
    logprobs: Optional[List[Dict[int, Logprob]]]
    finish_reason: Optional[str] = None
    stop_reason: Optional[str] = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: List[int]
    prompt_logprobs: Optional[List[Optional[Dict[int, Logprob]]]]
    outputs: List[CompletionOutput]
    finished: bool
    seed: Optional[int] = None


def _position(chosen: int, chosen_logprob: float, top: list, piece: str,
              chosen_rank: Optional[int] = None) -> Dict[int, Logprob]:
    """One position's logprobs as vLLM reports them: the top ids, and the chosen one."""
    out = {int(t): Logprob(float(lp), rank + 1, p) for rank, (t, lp, p) in enumerate(top)}
    if chosen not in out:
        out[chosen] = Logprob(float(chosen_logprob), chosen_rank, piece)
    return out


def _completion(c: dict, want_logprobs: bool) -> CompletionOutput:
    logprobs = None
    if want_logprobs:
        tops = c["top_logprobs"] or [[] for _ in c["token_ids"]]
        logprobs = [_position(t, lp, top, piece) for t, lp, top, piece
                    in zip(c["token_ids"], c["token_logprobs"], tops, c["token_pieces"])]
    return CompletionOutput(
        index=c["index"], text=c["text"], token_ids=list(c["token_ids"]),
        cumulative_logprob=float(sum(c["token_logprobs"])) if want_logprobs else None,
        logprobs=logprobs, finish_reason=c["finish_reason"], stop_reason=c["stop_reason"])


def _prompt_logprobs(raw, prompt_ids, engine) -> Optional[list]:
    if raw is None:
        return None
    out: list = []
    for token, s in zip(prompt_ids, raw):
        if s is None:
            out.append(None)
            continue
        out.append(_position(token, s["logprob"], s["top"], engine.decode([token], False), s["rank"]))
    return out


Prompt = Union[str, Dict[str, Any], Sequence[int]]

# What a prompt dict may hold, as vLLM's `TextPrompt` and `TokensPrompt` do.
_PROMPT_KEYS = {"prompt", "prompt_token_ids", "multi_modal_data"}


def _image_bytes(image: Any, i: int) -> bytes:
    """An image of `multi_modal_data` as its file's bytes: a PIL image is written as PNG
    (lossless: the pixels the engine sees are the image's), bytes are taken as a PNG, JPEG,
    WebP or GIF file."""
    if isinstance(image, (bytes, bytearray, memoryview)):
        return bytes(image)
    save = getattr(image, "save", None)
    if callable(save) and hasattr(image, "mode"):
        if image.mode not in ("RGB", "RGBA", "L", "LA", "P", "1", "I;16"):
            image = image.convert("RGB")
        out = io.BytesIO()
        image.save(out, format="PNG")
        return out.getvalue()
    raise TypeError(f"multi_modal_data image {i} is a PIL image or an image file's bytes, "
                    f"not {type(image).__name__}")


def _multi_modal_images(data: Any) -> List[bytes]:
    """`multi_modal_data` (`{"image": image or [images]}`) as the images' bytes, in order;
    other modalities are refused by name."""
    if not isinstance(data, dict):
        raise TypeError("multi_modal_data is a dict such as {\"image\": image}")
    other = sorted(set(data) - {"image"})
    if other:
        raise ValueError(f"multi_modal_data: {', '.join(map(repr, other))} is not supported "
                         "(images only)")
    images = data.get("image", [])
    if not isinstance(images, (list, tuple)):
        images = [images]
    return [_image_bytes(image, i) for i, image in enumerate(images)]


class LLM:
    """An engine for offline generation. `model`: the default model's name, a GGUF file, an
    HF directory or a hub id `org/name[@revision][:QUANT]`. `engine_args`: the command
    line's engine flags as keywords (`kv_cache_mib=256`, `no_prefix_cache=True`,
    `device="cuda"`, `chat_template=...`); `True` turns a switch on."""

    def __init__(self, model: str = DEFAULT_MODEL, **engine_args: Any):
        known = set(_troupe.engine_flag_names())
        flags: List[str] = []
        for key, value in engine_args.items():
            name = key.replace("_", "-")
            if name not in known:
                raise ValueError(f"unknown engine argument `{key}` (the engine flags of "
                                 "`troupe generate --help`, `-` as `_`)")
            if value is None or value is False:
                # A switch left off, or a flag left at its default.
                continue
            if value is True:
                flags.append(f"--{name}")
            else:
                values = value if isinstance(value, (list, tuple)) else [value]
                flags += [f"--{name}={v}" for v in values]
        self._engine = _troupe.Engine(model, flags)
        self._next_id = 0
        #: The model's context, in tokens (prompt and generated).
        self.max_model_len: int = self._engine.max_model_len

    def get_num_unfinished_requests(self) -> int:
        """Requests admitted and not finished (running or waiting), as vLLM's engine says."""
        return self._engine.num_unfinished_requests()

    # Prompts ----------------------------------------------------------------------------

    def _prompt(self, p: Prompt) -> tuple:
        """`(text, ids, images)`: images as their files' bytes, each standing at one image
        placeholder of the prompt (`<|image_pad|>` for Qwen2.5-VL), as vLLM takes them."""
        if isinstance(p, str):
            return p, self._engine.encode(p), []
        if isinstance(p, dict):
            unknown = sorted(set(p) - _PROMPT_KEYS)
            if unknown:
                raise ValueError(f"unknown prompt key(s) {', '.join(map(repr, unknown))} "
                                 f"(a prompt dict takes {', '.join(sorted(_PROMPT_KEYS))})")
            images = _multi_modal_images(p["multi_modal_data"]) if "multi_modal_data" in p else []
            if "prompt_token_ids" in p:
                return p.get("prompt"), [int(t) for t in p["prompt_token_ids"]], images
            if "prompt" in p:
                return p["prompt"], self._engine.encode(p["prompt"]), images
            raise ValueError("a prompt dict needs `prompt` or `prompt_token_ids`")
        if isinstance(p, (list, tuple)) and all(isinstance(t, int) for t in p):
            return None, list(p), []
        raise TypeError(f"a prompt is a string, a list of token ids or a dict, not {type(p).__name__}")

    def _wire(self, ids: List[int], images: List[bytes], params: SamplingParams) -> dict:
        if not isinstance(params, SamplingParams):
            raise TypeError("sampling_params must be a troupe.SamplingParams")
        return {"prompt_token_ids": ids, "params": params._wire(), "max_context_tokens": self.max_model_len,
                "images": [base64.b64encode(b).decode("ascii") for b in images]}

    def _output(self, prompt, ids, choices: List[dict], params: SamplingParams) -> RequestOutput:
        self._next_id += 1
        errors = [c["error"] for c in choices if c.get("error")]
        if errors:
            raise RuntimeError(errors[0])
        first = choices[0] if choices else {}
        return RequestOutput(
            request_id=str(self._next_id), prompt=prompt, prompt_token_ids=ids,
            prompt_logprobs=_prompt_logprobs(first.get("prompt_logprobs"), ids, self._engine),
            outputs=[_completion(c, params.logprobs is not None) for c in choices],
            finished=all(c["finish_reason"] is not None for c in choices), seed=first.get("seed"))

    # Generation -------------------------------------------------------------------------

    def generate(self, prompts: Union[Prompt, Sequence[Prompt]],
                 sampling_params: Union[None, SamplingParams, Sequence[SamplingParams]] = None,
                 use_tqdm: bool = False) -> List[RequestOutput]:
        """Runs every prompt together (continuous batching); one `RequestOutput` a prompt,
        in order. `sampling_params`: one for all, or one per prompt."""
        if isinstance(prompts, (str, dict)) or (
                isinstance(prompts, (list, tuple)) and prompts and all(isinstance(t, int) for t in prompts)):
            prompts = [prompts]
        encoded = [self._prompt(p) for p in prompts]
        params = self._params(sampling_params, len(encoded))
        wire = [self._wire(ids, images, p) for (_, ids, images), p in zip(encoded, params)]
        raw = json.loads(self._engine.generate(json.dumps(wire)))
        # Prompt ids as the engine ran them: each image's placeholder widened to its tokens.
        return [self._output(text, r["prompt_token_ids"], r["choices"], p)
                for (text, _, _), r, p in zip(encoded, raw, params)]

    def chat(self, messages: Union[List[dict], List[List[dict]]],
             sampling_params: Union[None, SamplingParams, Sequence[SamplingParams]] = None,
             tools: Optional[List[dict]] = None, use_tqdm: bool = False) -> List[RequestOutput]:
        """One conversation (a list of `{"role", "content"}`) or a list of them, rendered
        through the model's chat template as the server renders Chat Completions (images as
        `image_url` parts with base64 `data:` URLs)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = []
        for conv in conversations:
            chat = {"messages": conv}
            if tools:
                chat["tools"] = tools
            rendered = json.loads(self._engine.chat_prompt(json.dumps(chat)))
            images = [base64.b64decode(b) for b in rendered["images"]]
            prompts.append({"prompt_token_ids": rendered["prompt_token_ids"],
                            "multi_modal_data": {"image": images}})
        return self.generate(prompts, sampling_params)

    def generate_stream(self, prompt: Prompt,
                        sampling_params: Optional[SamplingParams] = None) -> Iterator[RequestOutput]:
        """One prompt's output as it is generated: each `RequestOutput` carries the new
        text and tokens of one completion (`outputs[0].index` says which); the last of a
        completion has its `finish_reason`. Closing the iterator early aborts the request."""
        text, ids, images = self._prompt(prompt)
        params = self._params(sampling_params, 1)[0]
        stream = self._engine.stream(json.dumps(self._wire(ids, images, params)))
        ids = list(stream.prompt_token_ids)
        try:
            while True:
                raw = stream.next()
                if raw is None:
                    return
                yield self._output(text, ids, [json.loads(raw)], params)
        finally:
            stream.close()

    def _params(self, sampling_params, n: int) -> List[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams()] * n
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * n
        params = list(sampling_params)
        if len(params) != n:
            raise ValueError(f"{len(params)} sampling_params for {n} prompts")
        return params

    # Tokenizer --------------------------------------------------------------------------

    def encode(self, text: str) -> List[int]:
        """`text` as a completion prompt's token ids (with the model's BOS, if it adds one)."""
        return self._engine.encode(text)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._engine.decode(list(token_ids), skip_special_tokens)

    def shutdown(self) -> None:
        """Stops the engine after what is in flight (it also stops, without waiting for
        requests, when the `LLM` is garbage collected or the interpreter exits)."""
        self._engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
