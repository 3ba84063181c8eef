"""A steady load on an OpenAI endpoint, for rehearsing failures: ``clients`` threads,
each sending one request after another through the official ``openai`` client and
recording when it was sent, when it ended, and how (pure client side: no Ray).

    with Load(url, "smollm2", clients=8) as load:
        ...  # kill a host
    print(load.summary())

Non-streaming clients send short completions; ``streaming`` clients stream theirs
and record whether a stream that failed had already delivered tokens (a cut stream)
and whether it ended with an error rather than silently (a truncated answer).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

__all__ = ["Load", "Result"]


@dataclass
class Result:
    sent: float  # time.monotonic()
    done: float
    stream: bool
    tokens: int = 0
    error: str = ""  # empty: it succeeded
    cut: bool = False  # a stream that failed after tokens had arrived

    @property
    def latency(self) -> float:
        return self.done - self.sent


@dataclass
class Load:
    url: str
    model: str
    clients: int = 8
    streaming: int = 0  # how many of the clients stream
    max_tokens: int = 16
    timeout_s: float = 120.0  # per request: a hang shows up as an error naming it
    results: list[Result] = field(default_factory=list)

    def __post_init__(self):
        if not 0 <= self.streaming <= self.clients:
            raise ValueError(f"streaming={self.streaming} must be between 0 and "
                             f"clients={self.clients}")
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._waiting = 0  # requests sent and not yet answered

    def __enter__(self) -> Load:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        for i in range(self.clients):
            t = threading.Thread(target=self._client, args=(i, i < self.streaming),
                                 name=f"load-{i}", daemon=True)
            t.start()
            self._threads.append(t)

    def stop(self, timeout_s: float | None = None) -> None:
        """Stop sending; wait for the requests in flight (each ends within timeout_s)."""
        self._stop.set()
        deadline = time.monotonic() + (timeout_s or self.timeout_s + 10)
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        alive = [t.name for t in self._threads if t.is_alive()]
        if alive:
            raise TimeoutError(f"load clients {alive} still waiting after "
                               f"{timeout_s or self.timeout_s + 10:g} s")

    def in_flight(self) -> int:
        """Requests sent and not yet answered, now."""
        with self._lock:
            return self._waiting

    def _client(self, i: int, stream: bool) -> None:
        import openai

        client = openai.OpenAI(base_url=self.url, api_key="unused", timeout=self.timeout_s,
                               max_retries=0)
        n = 0
        # Staggered starts: clients that start together stay in step (an engine batch
        # ends them together), leaving moments with nothing in flight.
        self._stop.wait(0.3 * i)
        while not self._stop.is_set():
            prompt = f"Count from {n % 50}:"
            n += 1
            r = Result(sent=time.monotonic(), done=0.0, stream=stream)
            with self._lock:
                self._waiting += 1
            try:
                if stream:
                    usage = None
                    for chunk in client.completions.create(
                            model=self.model, prompt=prompt, max_tokens=self.max_tokens,
                            temperature=0, stream=True, stream_options={"include_usage": True},
                            extra_body={"ignore_eos": True}):
                        if chunk.choices and chunk.choices[0].text:
                            r.tokens += 1  # chunks with text: a cut stream sent some
                        usage = chunk.usage or usage
                    if usage is None or usage.completion_tokens < self.max_tokens:
                        r.error = (f"stream ended after {r.tokens} chunks, without its "
                                   f"{self.max_tokens} tokens and usage")
                        r.cut = r.tokens > 0  # a truncated answer that looks complete
                    else:
                        r.tokens = usage.completion_tokens
                else:
                    out = client.completions.create(
                        model=self.model, prompt=prompt, max_tokens=self.max_tokens,
                        temperature=0, extra_body={"ignore_eos": True})
                    r.tokens = out.usage.completion_tokens
            except Exception as e:  # noqa: BLE001 - what the user sees is the result
                r.error = f"{type(e).__name__}: {e}"[:300]
                r.cut = stream and r.tokens > 0
            r.done = time.monotonic()
            with self._lock:
                self._waiting -= 1
                self.results.append(r)

    # ---- reading the results ---------------------------------------------------------
    def between(self, t0: float, t1: float, *, stream: bool | None = None) -> list[Result]:
        """Requests sent in [t0, t1)."""
        with self._lock:
            return [r for r in self.results if t0 <= r.sent < t1
                    and (stream is None or r.stream == stream)]

    def tokens_per_s(self, t0: float, t1: float) -> float:
        """Tokens of the requests that ended in [t0, t1), per second."""
        with self._lock:
            return sum(r.tokens for r in self.results if t0 <= r.done < t1) / (t1 - t0)

    def failed(self, *, stream: bool | None = None) -> list[Result]:
        with self._lock:
            return [r for r in self.results if r.error
                    and (stream is None or r.stream == stream)]
