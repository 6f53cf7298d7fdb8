#!/usr/bin/env python3
"""Drives a running `troupe serve` (started here, on the default model) with the official
`openai` and `anthropic` Python SDKs: chat (stream and not), completions with token ids,
responses, messages, tool calls (auto, required, named; streamed and whole), json_schema
output validated with `jsonschema`, seeded reproducibility, n > 1, API errors in each API's
format, the special-token guard, /metrics and a client disconnect; then a server with an
API key and CORS (right and wrong keys through both SDKs, a preflight), SIGTERM's drain, and
a server of a generated vision-language checkpoint (`tests/goldens/qwen25vl/a`) taking images
through both SDKs as base64 parts, answering as transformers did, refusing bad images.

Run: python3 scripts/test_server_sdk.py target/release/troupe
     (needs `pip install openai anthropic jsonschema`)
"""

import base64
import json
import pathlib
import socket
import subprocess
import sys
import time
import urllib.request

import anthropic
import jsonschema
import openai


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(binary, *flags):
    """A `troupe serve` on a free port, once /health answers 200 (503 while loading)."""
    port = free_port()
    server = subprocess.Popen([binary, "serve", "--port", str(port), *flags],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    base = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            urllib.request.urlopen(base + "/health", timeout=1)
            return server, base
        except OSError:
            time.sleep(0.1)
    server.kill()
    raise SystemExit("server did not come up: " + server.stderr.read1().decode())


def stop(server):
    """SIGTERM drains the server; it exits 0."""
    server.terminate()
    return server.wait(timeout=60) == 0


def main(binary):
    server, base = start(binary)
    try:
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused")
        claude = anthropic.Anthropic(base_url=base, api_key="unused")
        checks = run_checks(client, base) + run_tool_checks(client) + run_responses_checks(client) \
            + run_anthropic_checks(claude) + run_http_checks(base)
    finally:
        checks_stop = [("SIGTERM drains the server and it exits 0", stop(server))]
    checks += checks_stop + run_auth_checks(binary) + run_image_checks(binary)
    failed = [name for name, ok in checks if not ok]
    for name, ok in checks:
        print(("ok    " if ok else "FAIL  ") + name)
    print(f"{len(checks) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0


def run_auth_checks(binary):
    """A server with a key and CORS, driven by both SDKs with the right and a wrong key."""
    server, base = start(binary, "--api-key", "sk-right", "--open-routes", "health",
                         "--allowed-origins", "https://app.example", "--served-model-name", "mine")
    checks = []
    try:
        ask = [{"role": "user", "content": "Say hi."}]
        good = openai.OpenAI(base_url=base + "/v1", api_key="sk-right")
        r = good.chat.completions.create(model="mine", messages=ask, max_tokens=4)
        checks.append(("the right key is let in (openai)", r.choices[0].message.content is not None))
        checks.append(("the served model name is listed", [m.id for m in good.models.list().data] == ["mine"]))
        try:
            openai.OpenAI(base_url=base + "/v1", api_key="sk-wrong").chat.completions.create(
                model="mine", messages=ask, max_tokens=4)
            checks.append(("a wrong key is an AuthenticationError (openai)", False))
        except openai.AuthenticationError as e:
            checks.append(("a wrong key is an AuthenticationError (openai)", "not valid" in str(e)))
        m = anthropic.Anthropic(base_url=base, api_key="sk-right").messages.create(
            model="mine", max_tokens=4, messages=ask)
        checks.append(("the right key is let in (anthropic)", m.type == "message"))
        try:
            anthropic.Anthropic(base_url=base, api_key="sk-wrong").messages.create(
                model="mine", max_tokens=4, messages=ask)
            checks.append(("a wrong key is an AuthenticationError (anthropic)", False))
        except anthropic.AuthenticationError as e:
            checks.append(("a wrong key is an AuthenticationError (anthropic)", "not valid" in str(e)))
        health = urllib.request.urlopen(base + "/health").status
        checks.append(("an opened route needs no key", health == 200))
        pre = urllib.request.Request(base + "/v1/chat/completions", method="OPTIONS", headers={
            "origin": "https://app.example", "access-control-request-method": "POST",
            "access-control-request-headers": "authorization,content-type"})
        with urllib.request.urlopen(pre) as r:
            checks.append(("a CORS preflight from an allowed origin is answered",
                           r.status == 200 and r.headers["access-control-allow-origin"] == "https://app.example"))
    finally:
        checks.append(("the keyed server drains and exits 0", stop(server)))
    return checks


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

    st = client.chat.completions.create(model=model, messages=ask, temperature=0, max_tokens=24, stop=["Paris"])
    checks.append(("the matched stop string is the choice's stop_reason",
                   st.choices[0].finish_reason == "stop" and getattr(st.choices[0], "stop_reason", None) == "Paris"
                   and "Paris" not in st.choices[0].message.content))

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


WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 24}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                                 "parameters": WEATHER_SCHEMA, "strict": True}}
TIME_TOOL = {"type": "function", "function": {"name": "get_time", "description": "Current time in a timezone",
                                              "parameters": {"type": "object", "properties": {"tz": {"type": "string"}},
                                                             "required": ["tz"], "additionalProperties": False},
                                              "strict": True}}


def no_repeats(pairs):
    """json.loads' object hook: a repeated key is an error (Python keeps the last silently)."""
    keys = [k for k, _ in pairs]
    if len(keys) != len(set(keys)):
        raise ValueError(f"repeated key in {keys}")
    return dict(pairs)


def valid(instance, schema):
    try:
        jsonschema.validate(instance, schema)
        return True
    except jsonschema.ValidationError:
        return False


def run_tool_checks(client):
    checks = []
    model = "smollm2-135m-instruct"
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = client.chat.completions.create(model=model, messages=ask, tools=[WEATHER_TOOL, TIME_TOOL],
                                       tool_choice="required", temperature=0, max_tokens=80)
    calls = r.choices[0].message.tool_calls or []
    checks.append(("tool_choice required gives a tool call", len(calls) == 1 and r.choices[0].finish_reason == "tool_calls"))
    args = json.loads(calls[0].function.arguments) if calls else None
    schema = WEATHER_SCHEMA if calls and calls[0].function.name == "get_weather" else TIME_TOOL["function"]["parameters"]
    checks.append(("strict tool arguments match the schema", args is not None and valid(args, schema)))

    # vLLM's rule: a forced call (required, named) keeps to its tool's schema, strict or not.
    loose = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                              "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
                                                             "required": ["city"]}}}
    lr = client.chat.completions.create(model=model, messages=ask, tools=[loose], tool_choice="required",
                                        temperature=0, max_tokens=80)
    lcalls = lr.choices[0].message.tool_calls or []
    largs = json.loads(lcalls[0].function.arguments, object_pairs_hook=no_repeats) if lcalls else None
    checks.append(("a required call to a non-strict tool keeps to its schema",
                   len(lcalls) == 1 and valid(largs, loose["function"]["parameters"])))
    # vLLM's strict default: a schema silent on extra keys gets only the keys it names.
    checks.append(("a forced call's arguments hold only the keys its schema names",
                   largs is not None and set(largs) <= set(loose["function"]["parameters"]["properties"])))
    for limit in (12, 40):
        cut = client.chat.completions.create(model=model, messages=ask, tools=[loose], tool_choice="required",
                                             temperature=0, max_tokens=limit)
        cut_calls = cut.choices[0].message.tool_calls or []
        checks.append((f"a call cut by max_tokens {limit} says why and carries no broken or repeated arguments",
                       cut.choices[0].finish_reason in ("length", "tool_calls")
                       and (cut.choices[0].finish_reason == "length") == (not cut_calls)
                       and all(isinstance(json.loads(c.function.arguments, object_pairs_hook=no_repeats), dict)
                               for c in cut_calls)))

    named = client.chat.completions.create(model=model, messages=ask, tools=[WEATHER_TOOL, TIME_TOOL],
                                           tool_choice={"type": "function", "function": {"name": "get_time"}},
                                           temperature=0.8, seed=5, max_tokens=80)
    ncalls = named.choices[0].message.tool_calls or []
    checks.append(("a named tool choice calls that tool",
                   len(ncalls) == 1 and ncalls[0].function.name == "get_time"
                   and valid(json.loads(ncalls[0].function.arguments), TIME_TOOL["function"]["parameters"])))

    chunks = list(client.chat.completions.create(model=model, messages=ask, tools=[WEATHER_TOOL, TIME_TOOL],
                                                 tool_choice="required", temperature=0, max_tokens=80, stream=True))
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    streamed_args = "".join(tc.function.arguments or "" for tc in deltas if tc.function)
    checks.append(("tool call arguments stream incrementally and equal the whole call",
                   len(deltas) > 2 and calls and streamed_args == calls[0].function.arguments
                   and deltas[0].id is not None and deltas[0].function.name == calls[0].function.name))

    none = client.chat.completions.create(model=model, messages=ask, tools=[WEATHER_TOOL], tool_choice="none",
                                          temperature=0, max_tokens=24)
    checks.append(("tool_choice none answers in text", not none.choices[0].message.tool_calls and none.choices[0].message.content))

    follow = ask + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21, "sky": "sunny"}'}]
    f = client.chat.completions.create(model=model, messages=follow, tools=[WEATHER_TOOL], tool_choice="none",
                                       temperature=0, max_tokens=40)
    checks.append(("a tool result round-trips into an answer", f.choices[0].finish_reason in ("stop", "length")
                   and bool(f.choices[0].message.content)))

    person = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 130}},
              "required": ["name", "age"], "additionalProperties": False}
    ok = True
    for seed in range(3):
        j = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Invent a person."}],
                                           response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": person, "strict": True}},
                                           temperature=1.0, seed=seed, max_tokens=60)
        try:
            ok = ok and valid(json.loads(j.choices[0].message.content), person)
        except json.JSONDecodeError:
            ok = False
    checks.append(("json_schema output validates with jsonschema (3 sampled replies)", ok))
    jo = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Give me a JSON object about cats."}],
                                        response_format={"type": "json_object"}, temperature=0, max_tokens=60)
    try:
        checks.append(("json_object output is an object", isinstance(json.loads(jo.choices[0].message.content), dict)))
    except json.JSONDecodeError:
        checks.append(("json_object output is an object", jo.choices[0].finish_reason == "length"))
    rx = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "A date?"}],
                                        extra_body={"structured_outputs": {"regex": "20[0-9]{2}-[01][0-9]-[0-3][0-9]"}},
                                        temperature=1.0, max_tokens=20)
    import re
    checks.append(("regex structured output matches", re.fullmatch(r"20\d{2}-[01]\d-[0-3]\d", rx.choices[0].message.content) is not None))
    try:
        client.chat.completions.create(model=model, messages=ask, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {"type": "strin"}}}}})
        checks.append(("an unsupported schema is a 400", False))
    except openai.BadRequestError as e:
        checks.append(("an unsupported schema is a 400 naming it", "JSON schema" in str(e)))
    return checks


def run_responses_checks(client):
    checks = []
    model = "smollm2-135m-instruct"
    r = client.responses.create(model=model, input="What is the capital of France?", temperature=0, max_output_tokens=24)
    checks.append(("responses answers sensibly", "Paris" in r.output_text and r.status == "completed"))
    checks.append(("responses reports usage", r.usage.output_tokens > 0 and r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens))
    events = list(client.responses.create(model=model, input="What is the capital of France?", temperature=0,
                                          max_output_tokens=24, stream=True))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = [e for e in events if e.type in ("response.completed", "response.incomplete")]
    checks.append(("streamed response equals the whole one", deltas == r.output_text and len(done) == 1
                   and done[0].response.output_text == r.output_text))
    checks.append(("response events are numbered in order", [e.sequence_number for e in events] == list(range(len(events)))))
    cut = client.responses.create(model=model, input="Write a long story about Paris.", temperature=0,
                                  max_output_tokens=4)
    cut_events = list(client.responses.create(model=model, input="Write a long story about Paris.", temperature=0,
                                              max_output_tokens=4, stream=True))
    cut_done = [e.item for e in cut_events if e.type == "response.output_item.done"]
    checks.append(("a cut response and its message both say incomplete, whole and streamed",
                   cut.status == "incomplete" and cut.output[-1].status == "incomplete"
                   and [e.type for e in cut_events][-1] == "response.incomplete"
                   and cut_done and cut_done[-1].status == "incomplete"))
    lp = client.responses.create(model=model, input="What is the capital of France?", temperature=0,
                                 max_output_tokens=8, top_logprobs=3)
    lps = lp.output[0].content[0].logprobs or []
    checks.append(("responses returns token logprobs with top_logprobs", len(lps) == lp.usage.output_tokens
                   and all(len(x.top_logprobs) == 3 and x.logprob <= 0 for x in lps)))
    seeded = [client.responses.create(model=model, input="Tell me a story.", temperature=1.0, max_output_tokens=16,
                                      extra_body={"seed": 11}).output_text for _ in range(2)]
    checks.append(("a seed reproduces a sampled response", seeded[0] == seeded[1]))
    t = client.responses.create(model=model, input=[{"role": "user", "content": "Weather in Rome?"}],
                                tools=[{"type": "function", "name": "get_weather", "description": "Current weather",
                                        "parameters": WEATHER_SCHEMA, "strict": True}],
                                tool_choice="required", temperature=0, max_output_tokens=80)
    fc = [o for o in t.output if o.type == "function_call"]
    checks.append(("responses tool call matches its schema", len(fc) == 1 and fc[0].name == "get_weather"
                   and valid(json.loads(fc[0].arguments), WEATHER_SCHEMA)))
    follow = client.responses.create(model=model, input=[{"role": "user", "content": "Weather in Rome?"},
                                                         {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city":"Rome","unit":"celsius"}'},
                                                         {"type": "function_call_output", "call_id": "c1", "output": "18 degrees, cloudy"}],
                                     temperature=0, max_output_tokens=30)
    checks.append(("responses takes function call outputs", follow.status in ("completed", "incomplete") and follow.output_text != ""))
    try:
        client.responses.create(model=model, input="hi", previous_response_id="resp_x")
        checks.append(("previous_response_id is a 400", False))
    except openai.BadRequestError as e:
        checks.append(("previous_response_id is a 400 naming it", "previous_response_id" in str(e)))
    return checks


def run_anthropic_checks(claude):
    checks = []
    model = "smollm2-135m-instruct"
    ask = [{"role": "user", "content": "What is the capital of France?"}]
    # This SDK no longer sends sampling fields: they go as extra body fields.
    greedy = {"temperature": 0}
    m = claude.messages.create(model=model, max_tokens=24, messages=ask, extra_body=greedy)
    text = "".join(b.text for b in m.content if b.type == "text")
    checks.append(("messages answers sensibly", "Paris" in text and m.stop_reason in ("end_turn", "max_tokens")))
    checks.append(("messages reports usage", m.usage.input_tokens > 0 and m.usage.output_tokens > 0))
    with claude.messages.stream(model=model, max_tokens=24, messages=ask, extra_body=greedy) as s:
        streamed = "".join(s.text_stream)
        final = s.get_final_message()
    checks.append(("streamed message equals the whole one", streamed == text and final.usage.output_tokens == m.usage.output_tokens))
    tool = {"name": "get_weather", "description": "Current weather", "input_schema": WEATHER_SCHEMA, "strict": True}
    t = claude.messages.create(model=model, max_tokens=80, messages=[{"role": "user", "content": "Weather in Oslo?"}],
                               tools=[tool], tool_choice={"type": "tool", "name": "get_weather"}, extra_body=greedy)
    uses = [b for b in t.content if b.type == "tool_use"]
    checks.append(("messages tool_use matches its schema", t.stop_reason == "tool_use" and len(uses) == 1
                   and valid(uses[0].input, WEATHER_SCHEMA)))
    with claude.messages.stream(model=model, max_tokens=80, messages=[{"role": "user", "content": "Weather in Oslo?"}],
                                tools=[tool], tool_choice={"type": "tool", "name": "get_weather"}, extra_body=greedy) as s:
        sfinal = s.get_final_message()
    suses = [b for b in sfinal.content if b.type == "tool_use"]
    checks.append(("a streamed tool_use equals the whole one", len(suses) == 1 and uses and suses[0].input == uses[0].input))
    follow = claude.messages.create(model=model, max_tokens=30, extra_body=greedy, tools=[tool], messages=[
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Oslo", "unit": "celsius"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "3 degrees, snow"}]}])
    js = claude.messages.create(model=model, max_tokens=60, messages=[{"role": "user", "content": "Weather in Oslo as JSON?"}],
                                output_config={"format": {"type": "json_schema", "schema": WEATHER_SCHEMA}})
    try:
        checks.append(("messages output_config json_schema validates",
                       valid(json.loads("".join(b.text for b in js.content if b.type == "text")), WEATHER_SCHEMA)))
    except json.JSONDecodeError:
        checks.append(("messages output_config json_schema validates", False))
    checks.append(("messages takes tool results", any(b.type in ("text", "tool_use") for b in follow.content)))
    stopped = claude.messages.create(model=model, max_tokens=40, messages=ask, extra_body=greedy,
                                     stop_sequences=["Paris"])
    checks.append(("a stop sequence is reported as Anthropic's stop_sequence",
                   stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == "Paris"
                   and "Paris" not in "".join(b.text for b in stopped.content if b.type == "text")))
    try:
        claude.messages.create(model=model, max_tokens=10, messages=ask, extra_body={"temperature": -2})
        checks.append(("bad temperature is an Anthropic 400", False))
    except anthropic.BadRequestError as e:
        checks.append(("bad temperature is an Anthropic 400", e.body.get("type") == "error" and "temperature" in str(e)))
    return checks


VL_CASE = pathlib.Path(__file__).resolve().parent.parent / "tests" / "goldens" / "qwen25vl" / "a"


def run_image_checks(binary):
    """The generated Qwen2.5-VL checkpoint's chats through both SDKs, images as base64:
    the prompt as transformers' processor made it, the reply transformers' greedy tokens."""
    cases = json.loads((VL_CASE / "cases.json").read_text())
    server, base = start(binary, "--model", str(VL_CASE), "--served-model-name", "tiny-vl",
                         "--kv-cache-mib", "8", "--block-size", "4", "--exact-activations")
    checks = []
    try:
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused")
        claude = anthropic.Anthropic(base_url=base, api_key="unused")

        def png64(i):
            return base64.b64encode((VL_CASE / "images" / f"{i}.png").read_bytes()).decode()

        def detokenize(ids):
            req = urllib.request.Request(base + "/detokenize", data=json.dumps({"tokens": ids}).encode(),
                                         headers={"content-type": "application/json"})
            return json.loads(urllib.request.urlopen(req).read())["prompt"]

        for c, chat in enumerate(cases["chats"]):
            def parts(content, image):
                if isinstance(content, str):
                    return content
                return [image(p["image"]) if p["type"] == "image" else {"type": "text", "text": p["text"]}
                        for p in content]
            openai_messages = [{"role": m["role"], "content": parts(m["content"], lambda i: {
                "type": "image_url", "image_url": {"url": "data:image/png;base64," + png64(i)}})}
                for m in chat["messages"]]
            want = detokenize(chat["greedy"])
            greedy = {"temperature": 0, "max_tokens": len(chat["greedy"]), "extra_body": {"ignore_eos": True}}
            r = client.chat.completions.create(model="tiny-vl", messages=openai_messages, **greedy)
            checks.append((f"chat {c} with images (openai): the processor's prompt, transformers' tokens",
                           r.usage.prompt_tokens == len(chat["ids"]) and r.choices[0].message.content == want))
            stream = client.chat.completions.create(model="tiny-vl", messages=openai_messages, stream=True, **greedy)
            streamed = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
            checks.append((f"chat {c} with images streamed (openai) equals the whole reply", streamed == want))
            system = [m["content"] for m in chat["messages"] if m["role"] == "system"]
            anthropic_messages = [{"role": m["role"], "content": parts(m["content"], lambda i: {
                "type": "image", "source": {"type": "base64", "media_type": "image/png", "data": png64(i)}})}
                for m in chat["messages"] if m["role"] != "system"]
            # Anthropic's API has no `ignore_eos`: the goldens' greedy tokens hold no EOS.
            m = claude.messages.create(model="tiny-vl", max_tokens=len(chat["greedy"]), messages=anthropic_messages,
                                       extra_body={"temperature": 0}, **({"system": system[0]} if system else {}))
            text = "".join(b.text for b in m.content if b.type == "text")
            checks.append((f"chat {c} with images (anthropic): the same prompt and tokens",
                           m.usage.input_tokens == len(chat["ids"]) and text == want))
        bad = [{"role": "user", "content": [{"type": "image_url", "image_url": {
            "url": "data:image/png;base64," + base64.b64encode(b"not a png").decode()}}]}]
        try:
            client.chat.completions.create(model="tiny-vl", messages=bad, max_tokens=2)
            checks.append(("a bad image is a 400 (openai)", False))
        except openai.BadRequestError as e:
            checks.append(("a bad image is a 400 naming its part (openai)", "messages[0].content[0]" in str(e)))
        remote = [{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "https://example.invalid/a.png"}}]}]
        try:
            claude.messages.create(model="tiny-vl", max_tokens=2, messages=remote)
            checks.append(("an image URL from a host not allowed is a 400 (anthropic)", False))
        except anthropic.BadRequestError as e:
            checks.append(("an image URL from a host not allowed is a 400 naming it (anthropic)", "example.invalid" in str(e)))
    finally:
        checks.append(("the vision-language server drains and exits 0", stop(server)))
    return checks


def run_http_checks(base):
    checks = []

    def post(path, data, ctype="application/json"):
        req = urllib.request.Request(base + path, method="POST", headers={"content-type": ctype}, data=data)
        try:
            with urllib.request.urlopen(req) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    status, body = post("/v1/chat/completions", b"{not json")
    checks.append(("invalid JSON is a 400 with an error object", status == 400 and "error" in json.loads(body)))
    status, body = post("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}).encode())
    checks.append(("a wrongly typed field is a 400 naming it", status == 400 and "temperature" in json.loads(body)["error"]["message"]))
    status, body = post("/v1/completions", b"{\"prompt\": \"" + b"a" * (5 << 20) + b"\"}")
    checks.append(("an oversized body is a 413", status == 413 and "error" in json.loads(body)))
    status, body = post("/v1/messages", json.dumps({"model": "nope", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}).encode())
    checks.append(("Anthropic errors keep Anthropic's shape", status == 404 and json.loads(body)["type"] == "error"))
    metrics = urllib.request.urlopen(base + "/metrics").read().decode()
    checks.append(("/metrics counts requests and latencies", "troupe_requests_total" in metrics
                   and "troupe_time_to_first_token_seconds_count" in metrics
                   and "troupe_kv_cache_usage_ratio" in metrics))
    return checks


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
