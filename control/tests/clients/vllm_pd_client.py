"""Drives fleetplane's gateway in front of a vLLM prefill engine and a vLLM decode engine
(disaggregated through vLLM's NixlConnector) with the official `openai` package.

Each answer through the P/D pair is checked against the same greedy request sent straight to
one engine (no hand-off): a decode engine that pulled wrong KV would say something else.

Usage: python vllm_pd_client.py BASE_URL API_KEY MODEL DIRECT_URL
Exits non-zero (with a traceback) on the first check that fails.
"""
import sys

from openai import OpenAI

base_url, api_key, model, direct_url = sys.argv[1:5]
client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=120)
direct = OpenAI(base_url=direct_url + "/v1", api_key="unused", max_retries=0, timeout=120)
# Random weights may sample the end-of-text token: vLLM's `ignore_eos` keeps lengths exact.
greedy = {"temperature": 0, "extra_body": {"ignore_eos": True}}

words = "the fleet routes every request to the engine that holds its prefix in cache".split()
prompt = " ".join(words[i % len(words)] for i in range(160))

# Completions, whole and streamed.
c = client.completions.create(model=model, prompt=prompt, max_tokens=12, **greedy)
want = direct.completions.create(model=model, prompt=prompt, max_tokens=12, **greedy)
assert c.usage.completion_tokens == 12, c.usage
assert c.choices[0].text == want.choices[0].text, (c.choices[0].text, want.choices[0].text)

chunks = list(
    client.completions.create(
        model=model, prompt=prompt + " again", max_tokens=20, stream=True, stream_options={"include_usage": True}, **greedy
    )
)
text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
usage = [ch.usage for ch in chunks if ch.usage is not None]
assert len(usage) == 1 and usage[0].completion_tokens == 20, chunks
want = direct.completions.create(model=model, prompt=prompt + " again", max_tokens=20, **greedy)
assert text == want.choices[0].text, (text, want.choices[0].text)

# A chat, streamed: the chat template is applied by both engines alike.
messages = [{"role": "user", "content": prompt}]
chunks = list(client.chat.completions.create(model=model, messages=messages, max_tokens=10, stream=True, **greedy))
text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
want = direct.chat.completions.create(model=model, messages=messages, max_tokens=10, **greedy)
assert text == want.choices[0].message.content, (text, want.choices[0].message.content)
assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length", chunks

# Several at once, sampled: each gets every token asked for.
import concurrent.futures

def one(i):
    r = client.completions.create(
        model=model, prompt=f"{i} {prompt}", max_tokens=8, temperature=1.0, seed=i, extra_body={"ignore_eos": True}
    )
    return r.usage.completion_tokens

with concurrent.futures.ThreadPoolExecutor(4) as pool:
    assert list(pool.map(one, range(8))) == [8] * 8

print("all checks passed")
