"""An agent written only against the `openai` client: it offers the model a calculator tool (`multiply`, which the
agent itself implements), runs the model's tool calls, sends the results back, and scores the final answer.
Nothing in it knows tidyrl: tidyrl calls `solve` once per episode with the base_url it serves (docs/agents.md).
"""

import json

import openai

TOOLS = [{"type": "function", "function": {
    "name": "multiply", "description": "a times b",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}]


HTTP = openai.DefaultHttpxClient()
"""One connection pool for every episode: building an OpenAI client with its own costs about 40 ms of Python (its
httpx client and SSL context), which 64 episodes at once would spend before their first call."""


def multiply(a: int, b: int) -> int:
    return a * b


def solve(base_url: str, row: dict) -> float:
    """1.0 when the model's final answer is the product the question asks for, else 0.0."""
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, http_client=HTTP)
    messages = [{"role": "user", "content": row["prompt"]}]
    for _ in range(3):
        reply = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, max_tokens=40)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return float((message.content or "").strip() == row["answer"])
        for call in message.tool_calls:
            try:
                result = multiply(**json.loads(call.function.arguments))
            except (TypeError, ValueError) as err:  # a malformed call: the model is told, and may try again
                result = f"error: {err}"
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": json.dumps({"name": "multiply", "result": result})})
    return 0.0
