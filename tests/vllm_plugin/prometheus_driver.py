"""A real Prometheus (Debian's `prometheus`) on 127.0.0.1 for the tests that check the
shipped rules (deploy/prometheus/kv_canary.rules.yml) against real servers: it scrapes its
target and evaluates every `INTERVAL`, with a copy of the rules whose alerts' ``for`` is
`INTERVAL` (the shipped durations are minutes; the expressions are the shipped ones)."""

import json
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml

from torch_kvcanary.testing.serve import free_ports, stop

RULES = Path(__file__).resolve().parents[2] / "deploy/prometheus/kv_canary.rules.yml"
# The scrape and evaluation interval, and every alert's `for` in the test's copy of the rules.
INTERVAL = "1s"
# The longest a state the test waits for may take: a few scrapes and evaluations.
SETTLE_S = 60.0


class Prometheus:
    """`prometheus` on 127.0.0.1 scraping ``target`` every `INTERVAL` with the test's copy of
    the rules, its data and log in ``directory``."""

    def __init__(self, directory: Path, target: str):
        self.directory, self.target = directory, target
        self.port = free_ports(1)

    def __enter__(self):
        binary = shutil.which("prometheus")
        if binary is None:
            pytest.fail("no `prometheus` on PATH: `apt-get install prometheus` (make test-prometheus does)")
        rules = self.directory / "rules.yml"
        rules.write_text(yaml.safe_dump(_short_for(yaml.safe_load(RULES.read_text()))))
        config = {
            "global": {"scrape_interval": INTERVAL, "evaluation_interval": INTERVAL},
            "rule_files": [str(rules)],
            "scrape_configs": [{"job_name": "vllm", "static_configs": [{"targets": [self.target]}]}],
        }
        (self.directory / "prometheus.yml").write_text(yaml.safe_dump(config))
        self._log = open(self.directory / "prometheus.log", "w")  # noqa: SIM115 (closed in __exit__)
        command = [
            binary,
            f"--config.file={self.directory / 'prometheus.yml'}",
            f"--storage.tsdb.path={self.directory / 'data'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
        ]
        self._process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT)
        try:
            self.wait_for(self._ready, "Prometheus ready")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc):
        stop(self._process, timeout=30)
        self._log.close()

    def _get(self, path: str) -> dict:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=10) as answer:
            return json.loads(answer.read())

    def _ready(self) -> bool:
        if self._process.poll() is not None:
            pytest.fail(f"prometheus exited with {self._process.returncode}:\n{(self.directory / 'prometheus.log').read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=5) as answer:
                return answer.status == 200
        except (urllib.error.URLError, ConnectionError):
            return False

    def query(self, expr: str) -> dict[tuple, float]:
        """The instant vector ``expr`` evaluates to now: each series' labels (sorted pairs) and value."""
        answer = self._get("/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
        assert answer["status"] == "success" and answer["data"]["resultType"] == "vector", (expr, answer)
        return {tuple(sorted(series["metric"].items())): float(series["value"][1]) for series in answer["data"]["result"]}

    def value(self, expr: str) -> float:
        (value,) = self.query(expr).values()
        return value

    def alert_states(self) -> dict[str, str]:
        """Each alerting rule's state: inactive, pending or firing."""
        groups = self._get("/api/v1/rules?type=alert")["data"]["groups"]
        return {rule["name"]: rule["state"] for group in groups for rule in group["rules"]}

    def wait_for(self, condition, what: str):
        deadline = time.monotonic() + SETTLE_S
        while not (result := condition()):
            if time.monotonic() > deadline:
                pytest.fail(f"not within {SETTLE_S} s: {what}")
            time.sleep(0.5)
        return result


def _short_for(rules: dict) -> dict:
    """``rules`` with each alert's ``for`` set to `INTERVAL`."""
    for group in rules["groups"]:
        for rule in group["rules"]:
            if "for" in rule:
                rule["for"] = INTERVAL
    return rules
