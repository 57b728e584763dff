"""`vllm serve` on vLLM's CPU build in a child process, and the workloads the server tests
send it.

`Server` starts `vllm serve` (vLLM's default multiprocess engine, OpenAI API on 127.0.0.1)
through `vllm_cli` in a process of its own with its log in a file, and talks to it over HTTP
with the standard library. The memory soak that runs through it is `soak.memory`.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

# vLLM's command line as a script (`vllm_cli`): what `Server` runs, and `vllm bench serve` too.
VLLM_CLI = Path(__file__).with_name("vllm_cli.py")

# vLLM's log format: "(PROCESS pid=PID) LEVEL MM-DD HH:MM:SS [FILE:LINE] MESSAGE".
VLLM_LINE = re.compile(r"^\((\S+) pid=(\d+)\) (\w+) \d\d-\d\d \d\d:\d\d:\d\d \[(\S+?):\d+\] (.*)$")


def server_options(dtype: str = "bfloat16", kv_bytes: int = 2 << 20, tokens_per_step: int = 128) -> tuple:
    """`vllm serve`'s options for the tiny models: sequences of up to 512 tokens, 8 at once,
    in blocks of 32 with prefix caching, ``kv_bytes`` of KV cache in ``dtype``, and at most
    ``tokens_per_step`` tokens a step."""
    return (
        "--max-model-len", "512", "--block-size", "32", "--kv-cache-memory-bytes", str(kv_bytes),
        "--max-num-seqs", "8", "--dtype", dtype, "--enable-prefix-caching", "--max-num-batched-tokens", str(tokens_per_step),
    )  # fmt: skip


# The server every soak and server test starts: a small KV cache, so that a thousand
# requests reuse and evict its blocks many times over, and a small token budget per step,
# so that long prompts are prefilled in chunks.
SERVE_OPTIONS = server_options()


# Ports are handed out below the kernel's ephemeral range: a server binds its port up to a
# minute after the port is chosen, while the servers' own sockets bound to port 0 (vLLM's,
# NIXL's, UCX's) take ports from that range; once one took a port handed out here (Errno 98).
_PORTS = range(20000, 32000)
_handed_out: set[int] = set()


def free_port() -> int:
    """A port free on 127.0.0.1 now, outside the ephemeral range, not handed out before."""
    return free_ports(1)


def free_ports(count: int) -> int:
    """The first of ``count`` consecutive ports free on 127.0.0.1 now, outside the ephemeral
    range, none handed out before."""
    for first in random.sample(_PORTS[: len(_PORTS) - count + 1], len(_PORTS) - count + 1):
        run = range(first, first + count)
        if _handed_out.isdisjoint(run) and all(_bindable(port) for port in run):
            _handed_out.update(run)
            return first
    raise RuntimeError(f"no {count} consecutive free ports below the ephemeral range")


def _bindable(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@dataclass
class Server:
    """`vllm serve MODEL` with ``env`` over this environment less the plugin's switches."""

    model: Path
    env: dict = field(default_factory=dict)
    options: tuple = SERVE_OPTIONS
    start_timeout: float = 600.0
    port: int = field(default_factory=free_port)
    log_path: Path | None = None
    prefix: tuple = ()  # a command the server runs under (taskset)

    def __enter__(self) -> Server:
        self.start()
        return self.wait_healthy()

    def start(self) -> None:
        """Starts the server's process; `wait_healthy` waits for it to serve."""
        environment = {k: v for k, v in os.environ.items() if not k.startswith("KVCANARY_VLLM")}
        environment.update(self.env)
        if self.log_path is None:
            self.log_path = Path(tempfile.mkstemp(prefix="vllm-serve-", suffix=".log")[1])
        self._log = open(self.log_path, "w")  # noqa: SIM115 (closed in __exit__)
        command = [
            *self.prefix,
            sys.executable,
            str(VLLM_CLI),
            "serve",
            str(self.model),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *self.options,
        ]
        self._process = subprocess.Popen(command, env=environment, stdout=self._log, stderr=subprocess.STDOUT)

    def wait_healthy(self) -> Server:
        deadline = time.monotonic() + self.start_timeout
        while not self._healthy():
            if self._process.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {self._process.returncode} at start:\n{self.log()[-4000:]}")
            if time.monotonic() > deadline:
                self.__exit__(None, None, None)
                raise TimeoutError(f"vllm serve did not answer /health in {self.start_timeout} s:\n{self.log()[-4000:]}")
            time.sleep(1.0)
        return self

    def __exit__(self, *exc) -> None:
        stop(self._process, timeout=60)
        self._log.close()

    def kill_group(self) -> None:
        """SIGKILL to the server's process group, then waits for its first process: a server
        started under ``setsid`` (``prefix``) leads a group of its own, which takes along
        whatever vLLM left behind; nothing for a server never started."""
        process = getattr(self, "_process", None)
        if process is None:
            return
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=5) as answer:
                return answer.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False

    def alive(self) -> bool:
        return self._process.poll() is None and self._healthy()

    def complete(self, prompt: list[int], max_tokens: int, **params) -> dict:
        """One greedy completion of the token ids ``prompt`` (`complete`)."""
        return complete(self.url, self.model, prompt, max_tokens, **params)

    def metrics(self) -> str:
        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as answer:
            return answer.read().decode()

    def metric(self, name: str, **labels: str) -> float:
        """The sum of the Prometheus metric ``name`` in /metrics over its series with ``labels``."""
        pattern = re.compile(rf"^{re.escape(name)}(?:{{([^}}]*)}})? (\S+)$")
        wanted = {f'{label}="{value}"' for label, value in labels.items()}
        series = (m for m in map(pattern.match, self.metrics().splitlines()) if m)
        return sum(float(m[2]) for m in series if wanted <= set((m[1] or "").split(",")))

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def lines(self) -> list[tuple[str, int, str, str]]:
        """(process, pid, level, message) of each line of the log in vLLM's format."""
        found = []
        for line in self.log().splitlines():
            match = VLLM_LINE.match(line)
            if match:
                found.append((match[1], int(match[2]), match[3], match[5]))
        return found

    def canary_lines(self) -> list[tuple[str, int, str, str]]:
        return [line for line in self.lines() if line[3].startswith(("kv-canary", "kv_canary"))]

    def engine_pids(self) -> list[int]:
        """The engine's processes, found by the names in their log lines (so with the canary
        off as well): its core (the scheduler, with a connector's scheduler half) and its
        worker (the model runner, with the canary)."""
        processes = {(process, pid) for process, pid, _, _ in self.lines()}
        cores = {pid for process, pid in processes if process.startswith("EngineCore")}
        workers = {pid for process, pid in processes if process.startswith("Worker")}
        if len(cores) != 1 or len(workers) != 1:
            raise RuntimeError(f"expected one engine core and one worker in the server's log, found {sorted(cores)} and {sorted(workers)}")
        return [*cores, *workers]


def complete(url: str, model: Path, prompt: list[int], max_tokens: int, **params) -> dict:
    """One greedy completion of the token ids ``prompt`` by the server at ``url`` (OpenAI
    /v1/completions): its JSON answer, or {"error": status, "body": text} for an HTTP error."""
    body = dict(model=str(model), prompt=prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **params)
    request = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=600) as answer:
            return json.loads(answer.read())
    except urllib.error.HTTPError as error:
        return {"error": error.code, "body": error.read().decode(errors="replace")}


def stop(process: subprocess.Popen, timeout: float) -> None:
    """Ends ``process``: SIGTERM, then SIGKILL if it is still running ``timeout`` s later."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def collective_rpc(server: Server, method: str, *args: str) -> list:
    """Each worker's answer to ``method(*args)`` through vLLM's /collective_rpc (a server
    with VLLM_SERVER_DEV_MODE=1)."""
    body = json.dumps({"method": method, "args": list(args)}).encode()
    request = urllib.request.Request(server.url + "/collective_rpc", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as answer:
        return json.loads(answer.read())["results"]


# A vLLM general plugin of the tests' own (`install_flip_plugin`): it gives each worker a
# method that flips one bit of the slot holding a given token at a given position, which
# `flip` calls through /collective_rpc.
FLIP_PLUGIN = """
def register():
    from vllm.v1.worker.worker_base import WorkerBase

    def kvcanary_test_flip(self, token, position):
        import torch
        from torch_kvcanary.integrations.vllm import plugin

        state = plugin.active()
        records = state.canary.records
        # A hybrid model's groups each hold the token in a slot of their own: the first is flipped.
        slot = ((records[:, 0] == int(token)) & (records[:, 1] == int(position))).nonzero().flatten().tolist()[0]
        block, offset = divmod(slot, state.block_size)
        cache = state.kv_caches[0].view(torch.int16)
        at = (block, offset, 3) if cache.dim() == 3 else (block, 0, offset, 3)  # MLA's latent rows, or K and V
        cache[at] ^= 1 << 9
        return slot

    WorkerBase.kvcanary_test_flip = kvcanary_test_flip
"""


def install_flip_plugin(directory: Path) -> Path:
    """`FLIP_PLUGIN` installed in ``directory``, for a server's PYTHONPATH (`path_with`)."""
    return install_vllm_plugin(directory, "kvcanary_test_faults", FLIP_PLUGIN)


def flip(server: Server, token: int, position: int) -> int:
    """Flips a bit of the slot holding ``token`` at ``position`` in ``server``'s (first)
    worker, a server with `FLIP_PLUGIN` and VLLM_SERVER_DEV_MODE=1; the slot."""
    return collective_rpc(server, "kvcanary_test_flip", str(token), str(position))[0]


def install_vllm_plugin(directory: Path, module: str, source: str) -> Path:
    """Installs ``source`` (dedented) as module ``module`` in ``directory``, a vLLM general
    plugin (entry point ``register``) of a distribution of the same name, and returns
    ``directory``, to go on the PYTHONPATH of the vLLM processes that should load it."""
    (directory / f"{module}.py").write_text(textwrap.dedent(source))
    info = directory / f"{module}-0.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module.replace('_', '-')}\nVersion: 0.0\n")
    (info / "entry_points.txt").write_text(f"[vllm.general_plugins]\n{module} = {module}:register\n")
    return directory


def path_with(site: Path) -> str:
    """A PYTHONPATH with ``site`` (a plugin's directory) first, then this process's own."""
    return os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))


def anonymous_resident_bytes(pids: list[int]) -> int:
    """The anonymous resident memory of processes ``pids`` together (Linux /proc: RssAnon),
    where a leak of the heap lands; pages of mapped files (libraries paged in as code runs)
    are left out."""
    return sum(_anonymous_resident_bytes(pid) for pid in pids)


def _anonymous_resident_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no RssAnon for process {pid}")


def mixed_prompts(count: int, vocab_size: int, seed: int = 0) -> list[tuple[list[int], int]]:
    """``count`` (prompt, max_tokens) pairs: each prompt one of eight shared prefixes (of 16
    to 200 tokens) and a tail of its own (1 to 150 tokens), 1 to 48 tokens to generate."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(2, vocab_size) for _ in range(rng.randrange(16, 200))] for _ in range(8)]
    prompts = []
    for _ in range(count):
        tail = [rng.randrange(2, vocab_size) for _ in range(rng.randrange(1, 150))]
        prompts.append((rng.choice(prefixes) + tail, rng.randrange(1, 48)))
    return prompts


# A request of the preemption burst: 320 prompt tokens and 160 to generate, 15 blocks of 32
# at its end. SERVE_OPTIONS's 2 MiB of KV hold 64 such blocks for the tiny Llama (2 layers x
# K and V x 2 heads x 64 x bfloat16, 32 KiB a block), and fewer for any larger model.
BURST_PROMPT_TOKENS, BURST_GENERATED_TOKENS = 320, 160


def preemption_burst(count: int, vocab_size: int, seed: int = 1) -> list[tuple[list[int], int]]:
    """``count`` (prompt, max_tokens) pairs of distinct prompts (no prefix to share) that,
    sent together, outgrow the server's KV pool on any host: 5 of them running at once need
    75 blocks of 64, and each runs 160 decode steps, far longer than ``count`` requests take
    to arrive, so vLLM must preempt some of them to decode the others."""
    rng = random.Random(seed)
    return [([rng.randrange(2, vocab_size) for _ in range(BURST_PROMPT_TOKENS)], BURST_GENERATED_TOKENS) for _ in range(count)]
