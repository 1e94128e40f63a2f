"""The gateway's refusals as the official `openai` client sees them, whatever engines serve."""
import openai
from openai import OpenAI


def check_refusals(client, base_url, model):
    """An unknown model is a 404, an oversized request a 400 naming max_tokens, a wrong key a 401."""
    try:
        client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
        raise AssertionError("an unknown model was accepted")
    except openai.NotFoundError as e:
        assert e.status_code == 404

    try:
        client.completions.create(model=model, prompt="x", max_tokens=10_000_000)
        raise AssertionError("an oversized request was accepted")
    except openai.BadRequestError as e:
        assert "max_tokens" in str(e), e

    try:
        OpenAI(base_url=base_url, api_key="wrong", max_retries=0).models.list()
        raise AssertionError("a wrong key was accepted")
    except openai.AuthenticationError as e:
        assert e.status_code == 401
