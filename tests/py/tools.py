"""Tool calls through Ferry with the official `openai` client: a named function and
`required` (constrained to the tools' schemas), `auto` (Hermes-format calls parsed out of the
text; a regex makes the random test model write one), whole and streamed; a conversation
that carries earlier calls and their results; bad tools refused with a 400 naming the field.
Run by tests/tests/structured.rs: python3 tools.py BASE_URL MODEL"""

import json
import sys

import jsonschema
import openai

base, model = sys.argv[1], sys.argv[2]
c = openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=120)
msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
weather = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
time_params = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"], "additionalProperties": False}
tools = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": weather}},
    {"type": "function", "function": {"name": "get_time", "description": "The time in a zone", "parameters": time_params}},
]
schemas = {"get_weather": weather, "get_time": time_params}


def check_calls(calls, names):
    assert calls, "no tool calls"
    for call in calls:
        assert call.type == "function" and call.id, call
        assert call.function.name in names, call
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def streamed(**kw):
    """A streamed answer's content, calls (accumulated from their deltas) and finish reason."""
    content, calls, finish = "", {}, None
    for ch in c.chat.completions.create(model=model, stream=True, **kw):
        if not ch.choices:
            continue
        d = ch.choices[0].delta
        content += d.content or ""
        for tc in d.tool_calls or []:
            acc = calls.setdefault(tc.index, {"name": "", "arguments": ""})
            acc["name"] += tc.function.name or ""
            acc["arguments"] += tc.function.arguments or ""
        finish = ch.choices[0].finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


# A named function: one call to it, its arguments valid.
named = {"type": "function", "function": {"name": "get_weather"}}
for t in (0, 1):
    r = c.chat.completions.create(model=model, messages=msgs, tools=tools, tool_choice=named, max_tokens=200, temperature=t, seed=1)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content is None, ch
    check_calls(ch.message.tool_calls, {"get_weather"})
    assert len(ch.message.tool_calls) == 1, ch
content, calls, finish = streamed(messages=msgs, tools=tools, tool_choice=named, max_tokens=200, temperature=0)
assert finish == "tool_calls" and content == "" and len(calls) == 1, (content, calls, finish)
assert calls[0]["name"] == "get_weather", calls
whole = c.chat.completions.create(model=model, messages=msgs, tools=tools, tool_choice=named, max_tokens=200, temperature=0)
assert json.loads(calls[0]["arguments"]) == json.loads(whole.choices[0].message.tool_calls[0].function.arguments)

# Required: one or more calls, each to one of the tools.
for t in (0, 1):
    r = c.chat.completions.create(model=model, messages=msgs, tools=tools, tool_choice="required", max_tokens=300, temperature=t, seed=2)
    assert r.choices[0].finish_reason == "tool_calls", r
    check_calls(r.choices[0].message.tool_calls, set(schemas))

# Required with schemas that use $defs (as pydantic writes them): each tool's refs still resolve.
point = {"type": "object", "properties": {"at": {"$ref": "#/$defs/Point"}}, "required": ["at"], "additionalProperties": False,
         "$defs": {"Point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}},
                             "required": ["x"], "additionalProperties": False}}}
moves = [{"type": "function", "function": {"name": "move_to", "parameters": point}}, tools[1]]
r = c.chat.completions.create(model=model, messages=msgs, tools=moves, tool_choice="required", max_tokens=300, temperature=1, seed=5)
calls = r.choices[0].message.tool_calls
assert r.choices[0].finish_reason == "tool_calls" and calls, r
for call in calls:
    jsonschema.validate(json.loads(call.function.arguments), point if call.function.name == "move_to" else time_params)

# Auto: the model's Hermes-format call is parsed out of its text (the regex stands in for a
# model that knows the format), whole and streamed; text before it stays content.
hermes = r'I will check\.\n<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Oslo)", "unit": "celsius"\}\}\n</tool_call>'
r = c.chat.completions.create(model=model, messages=msgs, tools=tools, max_tokens=200, temperature=1, seed=3, extra_body={"guided_regex": hermes})
ch = r.choices[0]
assert ch.finish_reason == "tool_calls" and ch.message.content.startswith("I will check."), ch
check_calls(ch.message.tool_calls, {"get_weather"})
content, calls, finish = streamed(messages=msgs, tools=tools, max_tokens=200, temperature=1, seed=3, extra_body={"guided_regex": hermes})
assert finish == "tool_calls" and "<tool_call>" not in content and content.startswith("I will check."), (content, finish)
assert calls[0]["name"] == "get_weather" and json.loads(calls[0]["arguments"])["unit"] == "celsius", calls
# Without tools the same text is plain content.
r = c.chat.completions.create(model=model, messages=msgs, max_tokens=200, temperature=1, seed=3, extra_body={"guided_regex": hermes})
assert r.choices[0].message.tool_calls is None and "<tool_call>" in r.choices[0].message.content, r

# The tools are shown to the model: the prompt grows by their description.
plain = c.chat.completions.create(model=model, messages=msgs, max_tokens=1)
offered = c.chat.completions.create(model=model, messages=msgs, tools=tools, max_tokens=1)
assert offered.usage.prompt_tokens > plain.usage.prompt_tokens + 50, (offered.usage, plain.usage)

# A conversation carrying the call and its result.
call = whole.choices[0].message.tool_calls[0]
turns = msgs + [
    {"role": "assistant", "content": None, "tool_calls": [{"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
    {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 degrees."},
]
# Greedy and ignoring EOS, the answer is 8 tokens ("length": this model writes no call here);
# the prompt holds the call and its result: a longer result, or no call turn, changes its size
# by what was added or left out.
def answer(conversation):
    return c.chat.completions.create(model=model, messages=conversation, tools=tools, max_tokens=8, temperature=0,
                                     extra_body={"ignore_eos": True})
r = answer(turns)
assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 8, r
longer = answer(turns[:-1] + [dict(turns[-1], content="Sunny, 21 degrees. A light wind from the west.")])
assert longer.usage.prompt_tokens > r.usage.prompt_tokens, (longer.usage, r.usage)
no_call = answer(msgs + [{"role": "assistant", "content": "Let me see."}, turns[-1]])
assert no_call.usage.prompt_tokens < r.usage.prompt_tokens, (no_call.usage, r.usage)

# Bad tools: a 400 naming the field.
bad = [
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0].function.name"),
    ({"tools": tools, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "no such type"}}}], "tool_choice": "required"},
     "tools[].function.parameters"),
]
for body, field in bad:
    try:
        c.chat.completions.create(model=model, messages=msgs, max_tokens=5, **body)
        sys.exit(f"accepted: {body}")
    except openai.BadRequestError as e:
        assert field in str(e), (field, str(e))

print("tools: ok")
