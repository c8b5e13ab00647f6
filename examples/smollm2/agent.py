"""The tool task of tools.sh as an agent written only against the `openai` client, trained unchanged through
tidyrl's endpoint (docs/agents.md; agent.sh runs it).

SmolLM2's ChatML template has no tool section (the endpoint refuses a request whose `tools` it would drop), so the
agent does what an agent does with such a model: the prompt's system message describes the tool and its call format
(tools_env.SYSTEM), and the agent reads `<tool_call>` blocks out of the model's text itself, runs its own
`multiply`, and sends the result back as a `tool` message. A turn without a call is the answer: 1.0 when its last
number is the product.
"""

import json
import re
import sys
from pathlib import Path

import openai

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tools_env import last_number  # noqa: E402

HTTP = openai.DefaultHttpxClient()  # one connection pool for every episode (a client of its own costs ~40 ms)
CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)


def multiply(a, b) -> int:
    return int(a) * int(b)


def solve(base_url: str, prompt: list, row: dict) -> float:
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, http_client=HTTP)
    messages = list(prompt)  # [system: the tool, user: the question]
    for _ in range(3):
        reply = client.chat.completions.create(model="policy", messages=messages, max_tokens=48)
        text = reply.choices[0].message.content or ""
        messages.append({"role": "assistant", "content": text})
        calls = CALL.findall(text)
        if not calls:
            return float(last_number(text) == int(row["answer"]))
        try:
            call = json.loads(calls[0])
            result = {"name": "multiply", "result": multiply(**call["arguments"])}
        except (ValueError, TypeError, KeyError) as err:
            result = {"error": f"{type(err).__name__}: {err}"}
        messages.append({"role": "tool", "content": json.dumps(result)})
    return 0.0
