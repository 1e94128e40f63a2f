"""Drives the fleetplane gateway with the official `openai` package.

Usage: python openai_client.py BASE_URL API_KEY MODEL
Exits non-zero (with a traceback) on the first check that fails.
"""
import sys

import openai
from openai import OpenAI

from gateway_errors import check_refusals

base_url, api_key, model = sys.argv[1], sys.argv[2], sys.argv[3]
client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=60)

models = [m.id for m in client.models.list()]
assert model in models, models

c = client.completions.create(model=model, prompt="Hello from the openai client", max_tokens=6)
assert c.choices[0].finish_reason == "length", c
assert c.usage.completion_tokens == 6, c.usage
assert c.choices[0].text, c

pieces = [ch.choices[0].text for ch in client.completions.create(model=model, prompt="stream me", max_tokens=5, stream=True) if ch.choices]
assert sum(1 for p in pieces if p) == 5, pieces

chat = client.chat.completions.create(
    model=model,
    messages=[{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say something."}],
    max_tokens=4,
)
assert chat.choices[0].message.role == "assistant", chat
assert chat.choices[0].message.content, chat
assert chat.usage.completion_tokens == 4, chat.usage

stream = client.chat.completions.create(
    model=model,
    messages=[{"role": "user", "content": "count"}],
    max_tokens=7,
    stream=True,
    stream_options={"include_usage": True},
)
deltas, usage, finish = [], None, None
for chunk in stream:
    if chunk.usage is not None:
        usage = chunk.usage
    for choice in chunk.choices:
        if choice.delta.content:
            deltas.append(choice.delta.content)
        if choice.finish_reason:
            finish = choice.finish_reason
assert len(deltas) == 7, deltas
assert finish == "length", finish
assert usage is not None and usage.completion_tokens == 7, usage

check_refusals(client, base_url, model)

# Fields engines of ours would not honour are refused, each named, rather than ignored.
chat_fields = {
    "tools": {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]},
    "tool_choice": {"tool_choice": "required"},
    "response_format": {"response_format": {"type": "json_object"}},
    "logit_bias": {"logit_bias": {"42": 5}},
    "presence_penalty": {"presence_penalty": 0.5},
}
for field, extra in chat_fields.items():
    try:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2, **extra)
        raise AssertionError(f"{field} was accepted")
    except openai.BadRequestError as e:
        assert e.status_code == 400 and e.body["param"] == field, (field, e.body)
try:
    client.completions.create(model=model, prompt="hi", max_tokens=2, best_of=3)
    raise AssertionError("best_of was accepted")
except openai.BadRequestError as e:
    assert e.body["param"] == "best_of", e.body
try:
    client.chat.completions.create(model=model, messages=[{"role": "user", "content": "a"}, {"role": "wizard", "content": "b"}], max_tokens=2)
    raise AssertionError("an unknown role was accepted")
except openai.BadRequestError as e:
    assert e.body["param"] == "messages[1].role", e.body
# Their defaults change nothing, and are taken.
ok = client.chat.completions.create(
    model=model, messages=[{"role": "developer", "content": "hi"}], max_tokens=2,
    response_format={"type": "text"}, tool_choice="none", presence_penalty=0, logit_bias={},
)
assert ok.usage.completion_tokens == 2, ok

print("openai client: all checks passed")
