"""Prompt logprobs through Ferry with the official `openai` client, as evaluation harnesses
ask for them (`echo: true, max_tokens: 0, logprobs: k`), through prefill + decode and
colocated: every prompt token comes back, the first without a logprob; scoring a prompt
gives the same figures as generating its last token; a cached prompt is scored whole.
Run by tests/tests/echo.rs: python3 echo.py PD_BASE_URL COLOCATED_BASE_URL MODEL"""

import math
import sys

import openai

pd_base, co_base, model = sys.argv[1], sys.argv[2], sys.argv[3]
pd = openai.OpenAI(base_url=pd_base, api_key="unused", max_retries=0, timeout=120)
co = openai.OpenAI(base_url=co_base, api_key="unused", max_retries=0, timeout=120)
ids = [5, 17, 42, 99, 3, 250, 7, 64, 128, 11, 200, 31] * 3


def score(client, prompt, k=2):
    r = client.completions.create(model=model, prompt=prompt, max_tokens=0, echo=True, logprobs=k)
    ch = r.choices[0]
    assert r.usage.completion_tokens == 0 and ch.finish_reason == "length", r
    return ch


results = {}
for name, client in (("pd", pd), ("co", co)):
    ch = score(client, ids)
    lp = ch.logprobs
    assert len(lp.tokens) == len(ids) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset), lp
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None, lp
    assert all(x <= 0 for x in lp.token_logprobs[1:]), lp
    assert all(len(t) >= 2 for t in lp.top_logprobs[1:]), lp
    # Scored again: the prompt is now cached on the node, and is still scored whole.
    again = score(client, ids).logprobs
    assert again.token_logprobs == lp.token_logprobs, (again.token_logprobs, lp.token_logprobs)
    results[name] = lp.token_logprobs
for a, b in zip(results["pd"][1:], results["co"][1:]):
    assert math.isclose(a, b, abs_tol=1e-4), (results["pd"], results["co"])

# Scoring agrees with generating: the greedy token after a prefix has the largest logprob of
# the distribution at that position, so the prefix + one more token, scored, must show that
# same logprob as the best alternative there.
for client in (pd, co):
    g = client.completions.create(model=model, prompt=ids[:20], max_tokens=1, temperature=0, logprobs=1)
    gen = g.choices[0].logprobs.token_logprobs[0]
    top = score(client, ids[:21], k=1).logprobs.top_logprobs[20]
    assert math.isclose(max(top.values()), gen, abs_tol=1e-4), (top, gen)

# Echo without logprobs: the prompt text comes back before the completion.
r = pd.completions.create(model=model, prompt="Once upon", max_tokens=3, echo=True, temperature=0)
assert r.choices[0].text.startswith("Once upon") and len(r.choices[0].text) > len("Once upon"), r
s = pd.completions.create(model=model, prompt="Once upon", max_tokens=3, echo=True, temperature=0, stream=True)
assert "".join(c.choices[0].text for c in s if c.choices) == r.choices[0].text

# Streamed scoring: the prompt's entries come in the first chunk.
s = pd.completions.create(model=model, prompt=ids, max_tokens=0, echo=True, logprobs=1, stream=True)
toks = [t for c in s if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.token_logprobs]
assert len(toks) == len(ids) and toks[0] is None, toks

# Echo on chat is refused by name.
try:
    pd.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=1, extra_body={"echo": True})
    sys.exit("echo on chat was accepted")
except openai.BadRequestError as e:
    assert "echo" in str(e), e
print("echo: ok")
