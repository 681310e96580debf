"""n > 1 through Ferry with the official `openai` client, through prefill + decode and
colocated: one prompt, n choices. Sequence i of a request with seed s samples exactly what a
request for one sequence with seed s + i does (its own random stream, and the KV it reads,
shared or copied, is the prompt's); greedy choices agree; usage counts the prompt once; a
stream carries every choice's deltas under its index, each ending once, usage on the last
chunk; a stop string ends one choice and leaves the others as they would be alone;
constraints hold for every choice; echo shows the prompt in every choice; bad n is refused
by name.
Run by tests/tests/fork.rs: python3 fork.py PD_BASE_URL COLOCATED_BASE_URL MODEL"""

import json
import sys

import jsonschema
import openai

pd_base, co_base, model = sys.argv[1], sys.argv[2], sys.argv[3]
pd = openai.OpenAI(base_url=pd_base, api_key="unused", max_retries=0, timeout=120)
co = openai.OpenAI(base_url=co_base, api_key="unused", max_retries=0, timeout=120)
# Long enough to span several KV pages (16 tokens each), not a whole number of them.
prompt = "The ferry crossed the grey water at dawn, carrying " * 5
SEED = 1234
MAX = 12


def one(client, seed, **kw):
    r = client.completions.create(
        model=model, prompt=prompt, max_tokens=MAX, temperature=1.0, seed=seed, logprobs=0,
        extra_body={"ignore_eos": True}, **kw)
    assert len(r.choices) == 1, r
    return r


for name, client in (("pd", pd), ("co", co)):
    singles = [one(client, SEED + i) for i in range(3)]
    r = client.completions.create(
        model=model, prompt=prompt, max_tokens=MAX, temperature=1.0, seed=SEED, n=3, logprobs=0,
        extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2], r
    for i, (c, s) in enumerate(zip(r.choices, singles)):
        got, want = c.logprobs.tokens, s.choices[0].logprobs.tokens
        assert got == want, (name, i, got, want)
        assert c.text == s.choices[0].text and c.finish_reason == "length", (name, i, c, s)
    assert len({c.text for c in r.choices}) > 1, ("sampled choices differ", r.choices)
    # The prompt counted once; every choice's tokens counted.
    assert r.usage.prompt_tokens == singles[0].usage.prompt_tokens, (r.usage, singles[0].usage)
    assert r.usage.completion_tokens == 3 * MAX, r.usage
    assert r.usage.total_tokens == r.usage.prompt_tokens + 3 * MAX, r.usage

    # Greedy: every choice is the greedy answer.
    g1 = client.completions.create(model=model, prompt=prompt, max_tokens=MAX, temperature=0)
    g = client.completions.create(model=model, prompt=prompt, max_tokens=MAX, temperature=0, n=2)
    assert [c.text for c in g.choices] == [g1.choices[0].text] * 2, (g, g1)

    # Streamed: each choice's deltas under its index add up to the whole answer's; one finish
    # per choice; usage (with every choice's tokens) on the last chunk.
    s = client.completions.create(
        model=model, prompt=prompt, max_tokens=MAX, temperature=1.0, seed=SEED, n=3, stream=True,
        extra_body={"ignore_eos": True})
    texts, finishes, usage, after_usage = {}, {}, None, 0
    for chunk in s:
        if usage is not None:
            after_usage += 1
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason:
                assert c.index not in finishes, ("one finish per choice", chunk)
                finishes[c.index] = c.finish_reason
        if chunk.usage:
            usage = chunk.usage
    assert texts == {c.index: c.text for c in r.choices}, (texts, r.choices)
    assert finishes == {0: "length", 1: "length", 2: "length"}, finishes
    assert usage is not None and usage.completion_tokens == 3 * MAX and after_usage == 0, usage

    # Chat, whole and streamed: a message per choice; the role opens each choice's deltas.
    msgs = [{"role": "user", "content": "Name a boat."}]
    c = client.chat.completions.create(model=model, messages=msgs, max_tokens=6, n=2, seed=SEED, temperature=1.0)
    assert [x.index for x in c.choices] == [0, 1] and all(x.message.role == "assistant" for x in c.choices), c
    s = client.chat.completions.create(
        model=model, messages=msgs, max_tokens=6, n=2, seed=SEED, temperature=1.0, stream=True)
    roles, content = {}, {}
    for chunk in s:
        for x in chunk.choices:
            if x.delta.role:
                assert x.index not in roles, ("the role comes once per choice", chunk)
                roles[x.index] = x.delta.role
            content[x.index] = content.get(x.index, "") + (x.delta.content or "")
    assert roles == {0: "assistant", 1: "assistant"}, roles
    assert content == {x.index: x.message.content for x in c.choices}, (content, c.choices)

    # A stop string found in one choice ends that choice alone (the decode worker stops its
    # sequence, long before its max_tokens); the others run on.
    text1 = singles[1].choices[0].text
    stop = text1[len(text1) // 2:len(text1) // 2 + 3]
    r = client.completions.create(
        model=model, prompt=prompt, max_tokens=400, temperature=1.0, seed=SEED, n=3, stop=[stop],
        extra_body={"ignore_eos": True})
    assert r.choices[1].finish_reason == "stop" and r.choices[1].text == text1[:text1.index(stop)], (r, stop)
    # The others are what a request for each alone, without the stop, writes up to its first
    # stop string, and end with "stop" there, or are all 400 tokens of it and end with "length".
    for i in (0, 2):
        alone = client.completions.create(
            model=model, prompt=prompt, max_tokens=400, temperature=1.0, seed=SEED + i,
            extra_body={"ignore_eos": True}).choices[0].text
        want = (alone[:alone.index(stop)], "stop") if stop in alone else (alone, "length")
        assert (r.choices[i].text, r.choices[i].finish_reason) == want, (i, stop, r.choices[i], want)

    # Constrained: every choice obeys the constraint (each sequence has its own matcher).
    r = client.completions.create(
        model=model, prompt=prompt, max_tokens=8, temperature=1.0, n=4,
        extra_body={"guided_choice": ["yes", "no", "maybe"]})
    assert all(c.text in ("yes", "no", "maybe") for c in r.choices), r
    # A schema whose every answer is short, so that each choice finishes, and with valid JSON.
    flag = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
            "required": ["ok", "n"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "flag", "schema": flag, "strict": True}}
    r = client.chat.completions.create(
        model=model, messages=msgs, max_tokens=40, temperature=1.0, n=4, seed=SEED, response_format=fmt)
    assert len(r.choices) == 4, r
    for c in r.choices:
        assert c.finish_reason == "stop", c
        jsonschema.validate(json.loads(c.message.content), flag)

    # Echo: the prompt and its logprobs open every choice.
    r = client.completions.create(model=model, prompt=prompt, max_tokens=2, n=2, echo=True, logprobs=1, seed=SEED)
    heads = [c.logprobs.tokens[:5] for c in r.choices]
    assert all(c.text.startswith(prompt) for c in r.choices), r
    assert heads[0] == heads[1] and all(c.logprobs.token_logprobs[0] is None for c in r.choices), r

# The same choices through prefill + decode and colocated.
a = pd.completions.create(model=model, prompt=prompt, max_tokens=MAX, temperature=1.0, seed=SEED, n=3,
                          extra_body={"ignore_eos": True})
b = co.completions.create(model=model, prompt=prompt, max_tokens=MAX, temperature=1.0, seed=SEED, n=3,
                          extra_body={"ignore_eos": True})
assert [c.text for c in a.choices] == [c.text for c in b.choices], (a, b)

# Bad n: a 400 naming it.
for bad in (0, 65):
    try:
        pd.completions.create(model=model, prompt="hi", max_tokens=2, n=bad)
        raise AssertionError(f"n = {bad} accepted")
    except openai.BadRequestError as e:
        assert f"sampling parameter n = {bad}: must be in [1, 64]" in str(e), e

print("fork: ok")
