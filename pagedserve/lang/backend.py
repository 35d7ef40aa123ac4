"""The HTTP side of a program: SGLang's native API (/generate, with pagedserve's tools), the
chat template's text (/tokenize) and the session state store."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx


class Runtime:
    """A running pagedserve (or SGLang) server at ``base_url``."""

    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = 600.0):
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.base_url = base_url.rstrip("/")
        self.http = httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout)
        self._model_info: dict | None = None

    # ---- generation ---------------------------------------------------------------------------
    def generate(self, text: str | list[str], sampling_params: dict, **extra: Any) -> Any:
        return self._post("/generate", {"text": text, "sampling_params": sampling_params, **extra})

    def generate_stream(
        self, text: str, sampling_params: dict, **extra: Any
    ) -> Iterator[tuple[str, dict]]:
        """(new text, meta_info) as the server streams; closing the iterator aborts it."""
        body = {"text": text, "sampling_params": sampling_params, "stream": True, **extra}
        with self.http.stream("POST", "/generate", json=body) as r:
            if r.status_code != 200:
                r.read()
                raise RuntimeError(_error(r))
            sent = 0
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(chunk["error"]["message"])
                yield chunk["text"][sent:], chunk["meta_info"]
                sent = len(chunk["text"])

    def chat_text(
        self, messages: list[dict], tools: list[dict] | None = None, add_generation_prompt=False
    ) -> str:
        """What the model's chat template makes of ``messages`` (and ``tools``)."""
        body = {"messages": messages, "add_generation_prompt": add_generation_prompt}
        return self._post("/tokenize", body | ({"tools": tools} if tools else {}))["prompt"]

    def cache_prefix(self, text: str, **extra: Any) -> int:
        """Prefill ``text`` (its full pages enter the prefix cache); its number of tokens."""
        return self.generate(text, {"max_new_tokens": 0}, **extra)["meta_info"]["prompt_tokens"]

    def score(self, text: str, choices: list[str], **extra: Any) -> list[float]:
        """Each choice's mean logprob per token after ``text`` (``extra``: e.g. SGLang's
        ``lora_path``, the adapter that scores)."""
        prompt_len = self.cache_prefix(text, **extra)
        results = self.generate(
            [text + c for c in choices],
            {"max_new_tokens": 0, "temperature": 0},
            return_logprob=True,
            logprob_start_len=prompt_len,
            **extra,
        )
        scores = []
        for r in results:
            values = [e[0] for e in r["meta_info"]["input_token_logprobs"] if e[0] is not None]
            scores.append(sum(values) / len(values) if values else float("-inf"))
        return scores

    def model_info(self) -> dict:
        if self._model_info is None:
            r = self.http.get("/get_model_info")
            if r.status_code != 200:
                raise RuntimeError(_error(r))
            self._model_info = r.json()
        return self._model_info

    # ---- session state ------------------------------------------------------------------------
    def load_state(self, session_id: str) -> dict:
        r = self.http.get(f"/sessions/{session_id}/state")
        if r.status_code == 404:
            return {}
        if r.status_code != 200:
            raise RuntimeError(_error(r))
        return r.json()

    def save_state(self, session_id: str, state: dict) -> None:
        r = self.http.put(f"/sessions/{session_id}/state", json=state)
        if r.status_code != 200:
            raise RuntimeError(_error(r))

    def delete_session(self, session_id: str) -> bool:
        return self.http.delete(f"/sessions/{session_id}/state").status_code == 204

    def _post(self, path: str, body: dict) -> Any:
        r = self.http.post(path, json=body)
        if r.status_code != 200:
            raise RuntimeError(_error(r))
        return r.json()

    def close(self) -> None:
        self.http.close()


RuntimeEndpoint = Runtime  # SGLang's name for a client of a running server


def _error(r: httpx.Response) -> str:
    try:
        return f"{r.status_code}: {r.json()['error']['message']}"
    except (ValueError, KeyError, TypeError):
        return f"{r.status_code}: {r.text}"
