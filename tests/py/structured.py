"""Structured outputs through Ferry with the official `openai` client: `response_format`
json_schema and json_object, vLLM's `guided_regex` / `guided_choice`, whole and streamed; 100
generated JSON Schemas, each answered through prefill + decode and colocated, greedy and at
temperature 1, every answer validated by `jsonschema`; bad constraints refused with a 400
naming the field. Run by tests/tests/structured.rs:
python3 structured.py PD_BASE_URL COLOCATED_BASE_URL MODEL"""

import json
import random
import re
import sys
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai

pd_base, co_base, model = sys.argv[1], sys.argv[2], sys.argv[3]
pd = openai.OpenAI(base_url=pd_base, api_key="unused", max_retries=0, timeout=120)
co = openai.OpenAI(base_url=co_base, api_key="unused", max_retries=0, timeout=120)
msgs = [{"role": "user", "content": "Answer in JSON."}]


def fmt(schema, name="answer"):
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


# A random JSON Schema: nested objects, arrays, enums, numbers, booleans, strings; required and
# optional properties; `additionalProperties: false`. Every string, array and number bounded so
# that even a model with random weights (the tiny test model) finishes.
def scalar(rng):
    k = rng.randrange(6)
    if k == 0:
        return {"type": "string", "maxLength": rng.randrange(1, 12)}
    if k == 1:
        lo = rng.randrange(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randrange(1, 1000)}
    if k == 2:
        # A multiple of 0.25 (else a random model writes decimals until max_tokens).
        return {"type": "number", "minimum": -100, "maximum": 100, "multipleOf": 0.25}
    if k == 3:
        return {"type": "boolean"}
    if k == 4:
        return {"enum": rng.sample(["red", "green", "blue", 1, 2.5, True, None, "a b"], rng.randrange(1, 5))}
    return {"type": "string", "enum": rng.sample(["north", "south", "east", "west"], rng.randrange(1, 4))}


def schema(rng, depth=0):
    k = rng.randrange(10)
    if depth < 2 and k < 3:
        return {"type": "array", "items": schema(rng, depth + 1), "maxItems": rng.randrange(1, 4)}
    if depth < 3 and k < 7:
        n = rng.randrange(1, 5)
        props = {f"k{depth}_{i}": schema(rng, depth + 1) for i in range(n)}
        req = sorted(rng.sample(sorted(props), rng.randrange(0, n + 1)))
        return {"type": "object", "properties": props, "required": req, "additionalProperties": False}
    return scalar(rng)


def top(rng):
    s = schema(rng)
    if s.get("type") != "object":
        s = {"type": "object", "properties": {"value": s}, "required": ["value"], "additionalProperties": False}
    return s


def ask(client, s, temperature, seed):
    r = client.chat.completions.create(
        model=model, messages=msgs, max_tokens=600, temperature=temperature, seed=seed, response_format=fmt(s)
    )
    ch = r.choices[0]
    assert ch.finish_reason == "stop", (s, ch)
    v = json.loads(ch.message.content)
    jsonschema.validate(v, s)
    return ch.message.content


# 1. One schema, whole and streamed: the same valid JSON.
person = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "maxItems": 2},
    },
    "required": ["name", "age", "pets"],
    "additionalProperties": False,
}
whole = ask(pd, person, 0, 1)
s = pd.chat.completions.create(model=model, messages=msgs, max_tokens=600, temperature=0, response_format=fmt(person), stream=True)
streamed = "".join(c.choices[0].delta.content or "" for c in s if c.choices)
assert streamed == whole, (streamed, whole)

# 2. Any JSON object: a whole one where the answer stopped, else (a random model may not close
# it in time) all 40 tokens of a prefix of one; greedy, the same through both paths.
class Incomplete(Exception):
    """The text ended inside a value: a prefix, not an error."""


def json_value(t, i):
    """Parses one JSON value of `t` from `i` (after whitespace); its end, or Incomplete."""
    ws = lambda i: len(t) if i >= len(t) else (ws(i + 1) if t[i] in " \t\r\n" else i)
    i = ws(i)
    if i == len(t):
        raise Incomplete
    if t[i] in "{[":
        close, i = "}" if t[i] == "{" else "]", ws(i + 1)
        if i < len(t) and t[i] == close:
            return i + 1
        while True:
            if close == "}":
                if i == len(t):
                    raise Incomplete
                assert t[i] == '"', (t, i)
                i = ws(json_value(t, i))
                if i == len(t):
                    raise Incomplete
                assert t[i] == ":", (t, i)
                i += 1
            i = ws(json_value(t, i))
            if i == len(t):
                raise Incomplete
            if t[i] == close:
                return i + 1
            assert t[i] == ",", (t, i)
            i = ws(i + 1)
    if t[i] == '"':
        j = i + 1
        while j < len(t) and t[j] != '"':
            j += 2 if t[j] == "\\" else 1
        if j >= len(t):
            raise Incomplete
        json.loads(t[i:j + 1])
        return j + 1
    m = re.match(r"true|tru|tr|t|false|fals|fal|fa|f|null|nul|nu|n|-?[0-9.eE+-]+", t[i:])
    assert m, (t, i)
    end = i + m.end()
    if end == len(t):
        raise Incomplete
    json.loads(t[i:end])
    return end


def is_json_object_prefix(t):
    """Whether `t` starts a JSON object that has not ended yet."""
    if not t.lstrip().startswith("{"):
        return False
    try:
        json_value(t, 0)
    except Incomplete:
        return True
    except (AssertionError, ValueError):
        return False
    return False  # a whole value


assert is_json_object_prefix('{"a": [1, tr') and is_json_object_prefix('{"a": "x\\"') and is_json_object_prefix("{")
assert not any(map(is_json_object_prefix, ('{"a" 1', '{"a": 1}', '[1', '{"a": tx', '{"a": 1}}')))
answers = []
for client in (pd, co):
    r = client.chat.completions.create(model=model, messages=msgs, max_tokens=40, temperature=0,
                                       response_format={"type": "json_object"})
    ch = r.choices[0]
    if ch.finish_reason == "stop":
        assert isinstance(json.loads(ch.message.content), dict), ch
    else:
        assert ch.finish_reason == "length" and r.usage.completion_tokens == 40, (ch, r.usage)
        assert is_json_object_prefix(ch.message.content), ch
    answers.append(ch.message.content)
assert answers[0] == answers[1], answers

# 3. vLLM's regex and choice, on completions and chat, whole and streamed.
for client in (pd, co):
    r = client.completions.create(model=model, prompt="A date:", max_tokens=20, temperature=1, seed=3,
                                  extra_body={"guided_regex": r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-2][0-9]"})
    assert re.fullmatch(r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-2][0-9]", r.choices[0].text), r
    assert r.choices[0].finish_reason == "stop", r
    s = client.chat.completions.create(model=model, messages=msgs, max_tokens=20, temperature=1, seed=4, stream=True,
                                       extra_body={"guided_choice": ["alpha", "beta gamma", "delta"]})
    text = "".join(c.choices[0].delta.content or "" for c in s if c.choices)
    assert text in ("alpha", "beta gamma", "delta"), text

# 4. 100 generated schemas × (prefill + decode, colocated) × (greedy, temperature 1).
rng = random.Random(17)
schemas = [top(rng) for _ in range(100)]
jobs = [(client, sc, t, i) for i, sc in enumerate(schemas) for client in (pd, co) for t in (0, 1)]
with ThreadPoolExecutor(8) as ex:
    outs = list(ex.map(lambda j: ask(*j), jobs))
assert len(outs) == 400
greedy_pd = outs[0::4]
greedy_co = outs[2::4]
assert greedy_pd == greedy_co, "greedy output differs between prefill + decode and colocated"

# 5. Bad constraints: a 400 naming what is wrong.
bad = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"guided_regex": "(?<=a)b"}, "regex"),
    ({"guided_choice": []}, "choice"),
]
for body, field in bad:
    try:
        pd.chat.completions.create(model=model, messages=msgs, max_tokens=5, extra_body=body)
        sys.exit(f"accepted: {body}")
    except openai.BadRequestError as e:
        assert field in str(e), (field, str(e))

print("structured outputs: ok")
