"""The official `openai` client against Ferry's router, sending what SDKs and agent
frameworks send: content as lists of parts, fields Ferry does not read (metadata, store,
user), streaming with usage, a model lookup, logprobs. Run by tests/tests/openai_client.rs:
python3 openai_client.py BASE_URL MODEL; exits non-zero with the reason on any mismatch."""

import sys

import openai

base, model = sys.argv[1], sys.argv[2]
c = openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=60)

assert c.models.retrieve(model).id == model

parts = [
    {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
    {"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]},
]
# ignore_eos (Ferry's, as vLLM's): every answer below is exactly max_tokens long, so its
# finish reason and token count are the request's to say, whatever the random model writes.
extra = {"metadata": {"app": "test"}, "store": False, "user": "u1", "seed": 1, "extra_body": {"ignore_eos": True}}
r = c.chat.completions.create(model=model, messages=parts, max_tokens=4, temperature=0, **extra)
assert r.choices[0].message.role == "assistant", r
text = r.choices[0].message.content
assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 4, r

# Streamed, with usage: the same text.
s = c.chat.completions.create(
    model=model, messages=parts, max_tokens=4, temperature=0, stream=True, stream_options={"include_usage": True}, **extra
)
chunks = list(s)
streamed = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
assert streamed == text, (streamed, text)
counts = lambda u: (u.prompt_tokens, u.completion_tokens, u.total_tokens)  # cached tokens vary
assert chunks[-1].usage is not None and counts(chunks[-1].usage) == counts(r.usage), (chunks[-1], r.usage)
assert [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason] == ["length"], chunks

# Text parts read as one string joined with newlines.
plain = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello\nthere"}]
r2 = c.chat.completions.create(model=model, messages=plain, max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
assert r2.choices[0].message.content == text and counts(r2.usage) == counts(r.usage), (r2, r)

# An image part: a 400 naming it.
image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]
try:
    c.chat.completions.create(model=model, messages=image, max_tokens=2)
    sys.exit("an image part was accepted")
except openai.BadRequestError as e:
    assert "messages[0].content[0]" in str(e), e

# Completions.
r3 = c.completions.create(model=model, prompt="Once upon a time", max_tokens=3, temperature=0, user="u1",
                          logprobs=0, extra_body={"ignore_eos": True})
assert r3.choices[0].finish_reason == "length" and r3.usage.completion_tokens == 3, r3
assert "".join(r3.choices[0].logprobs.tokens) == r3.choices[0].text, r3

# A batch of prompts, as strings and as token-id lists (what lm-eval's local-completions
# sends): one choice per prompt, in order, each the answer the prompt gets alone.
r7 = c.completions.create(model=model, prompt=["Once upon a time", "Hello"], max_tokens=3, temperature=0,
                          extra_body={"ignore_eos": True})
assert [ch.index for ch in r7.choices] == [0, 1], r7
assert r7.choices[0].text == r3.choices[0].text, (r7, r3)
r8 = c.completions.create(model=model, prompt=[[5, 6, 7], [8, 9]], max_tokens=3, temperature=0, echo=True, logprobs=1)
alone = c.completions.create(model=model, prompt=[8, 9], max_tokens=3, temperature=0, echo=True, logprobs=1)
assert r8.choices[1].text == alone.choices[0].text, (r8, alone)
assert r8.choices[1].logprobs.tokens == alone.choices[0].logprobs.tokens, (r8, alone)

# logit_bias as the client sends it (token ids as string keys): +100 forces token 7.
r9 = c.chat.completions.create(model=model, messages=plain, max_tokens=3, temperature=0, logit_bias={"7": 100})
sevens = c.completions.create(model=model, prompt=[7, 7, 7], max_tokens=0, echo=True)
assert r9.choices[0].message.content == sevens.choices[0].text, (r9, sevens)

# Logprobs: chat with alternatives, whole and streamed; completions with `logprobs: k`.
r5 = c.chat.completions.create(model=model, messages=plain, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2)
lp = r5.choices[0].logprobs.content
assert len(lp) == r5.usage.completion_tokens, r5
for e in lp:
    assert len(e.top_logprobs) == 2 and e.top_logprobs[0].token == e.token, e
    assert e.logprob <= 0 and isinstance(e.bytes, list), e
s5 = c.chat.completions.create(
    model=model, messages=plain, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2, stream=True
)
toks = [e.token for ch in s5 if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
assert toks == [e.token for e in lp], (toks, lp)
r6 = c.completions.create(model=model, prompt="Once upon a time", max_tokens=3, temperature=0, logprobs=2)
l6 = r6.choices[0].logprobs
n = r6.usage.completion_tokens
assert len(l6.tokens) == len(l6.token_logprobs) == len(l6.top_logprobs) == len(l6.text_offset) == n, l6
assert all(len(t) == 2 for t in l6.top_logprobs), l6
print("openai client: ok")
