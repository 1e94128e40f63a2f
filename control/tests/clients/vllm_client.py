"""Drives fleetplane's gateway in front of real vLLM engines with the official `openai` package.

Usage: python vllm_client.py BASE_URL API_KEY MODEL
Exits non-zero (with a traceback) on the first check that fails.
"""
import json
import random
import sys
import time
import urllib.request

import openai
from openai import OpenAI

from gateway_errors import check_refusals

base_url, api_key, model = sys.argv[1], sys.argv[2], sys.argv[3]
client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=120)
# Random weights may sample the end-of-text token: vLLM's `ignore_eos` keeps lengths exact.
extra = {"ignore_eos": True}

assert model in [m.id for m in client.models.list()]

c = client.completions.create(model=model, prompt="the fleet routes", max_tokens=6, extra_body=extra)
assert c.choices[0].finish_reason == "length", c
assert c.usage.completion_tokens == 6, c.usage

chunks = list(
    client.completions.create(
        model=model, prompt="stream me", max_tokens=5, stream=True, stream_options={"include_usage": True}, extra_body=extra
    )
)
usage = [ch.usage for ch in chunks if ch.usage is not None]
assert len(usage) == 1 and usage[0].completion_tokens == 5, chunks
assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length", chunks

chat = client.chat.completions.create(
    model=model, messages=[{"role": "user", "content": "Say something."}], max_tokens=4, extra_body=extra
)
assert chat.choices[0].message.role == "assistant", chat
assert chat.usage.completion_tokens == 4, chat.usage

def kv_messages():
    """KV event messages the control plane has applied, over all engines (`/api/engines`)."""
    req = urllib.request.Request(base_url.removesuffix("/v1") + "/api/engines", headers={"Authorization": f"Bearer {api_key}"})
    engines = json.load(urllib.request.urlopen(req, timeout=10))["engines"]
    return sum((e.get("events") or {}).get("messages", 0) for e in engines)


def wait_for_kv_events(before, secs=10):
    """Waits until the engine's KV events of a request reached the control plane: a next turn
    sent sooner races them (the index only knows what the events said). Events of an earlier
    request can still be arriving when `before` was read, so the count must also settle."""
    deadline = time.time() + secs
    last, quiet_since = kv_messages(), time.time()
    while last <= before or time.time() - quiet_since < 0.5:
        assert time.time() < deadline, f"KV events did not reach the control plane and settle in {secs} s"
        time.sleep(0.05)
        now = kv_messages()
        if now != last:
            last, quiet_since = now, time.time()


# A conversation's long system prompt is cached on the engine that served it first: the
# router must send its next turn there. Its block hashes come from the chat template as the
# control plane renders it, so this also holds the template to vLLM's rendering.
words = "the fleet routes every request to an engine that holds its prefix in cache while long prompts wait".split()
for i in range(4):
    rng = random.Random(i)
    system = " ".join(rng.choice(words) for _ in range(250))
    cached = []
    for turn in ["first question", "second question"]:
        if cached:
            wait_for_kv_events(seen)
        seen = kv_messages()
        stream = client.chat.completions.create(
            model=model,
            messages=[{"role": "system", "content": system}, {"role": "user", "content": turn}],
            max_tokens=3,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=extra,
        )
        u = [ch.usage for ch in stream if ch.usage is not None][0]
        assert u.completion_tokens == 3, u
        cached.append(u.prompt_tokens_details.cached_tokens)
    assert cached[0] == 0 and cached[1] >= 224, f"conversation {i}: cached tokens {cached}"

check_refusals(client, base_url, model)

# A field only the engine checks: its own 400, passed on in OpenAI's shape.
try:
    client.completions.create(model=model, prompt="x", max_tokens=2, extra_body={"top_k": -5})
    raise AssertionError("top_k -5 was accepted")
except openai.BadRequestError as e:
    assert e.status_code == 400, e

print("vllm client: all checks passed")
