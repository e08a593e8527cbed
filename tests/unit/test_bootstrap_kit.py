"""The bootstrap operator's kit (bootstrap/) stays true to the node: its command lines are ones
`p2p-diloco bootstrap` accepts, the image builds from files that exist, compose runs the image's
health check, the health check turns /healthz into an exit code, and the guide quotes real lines.
No docker here: the files are read as text (and compose.yaml as YAML)."""

import argparse
import ast
import json
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
import zipfile
from fnmatch import fnmatch
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from p2p_diloco.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
KIT = ROOT / "bootstrap"
HEALTHCHECK = KIT / "healthcheck.py"
PUBLIC_IP = "203.0.113.7"
# Flags of the observer, being added to `p2p-diloco bootstrap` in parallel; each takes one value.
PENDING = {"--observe-port", "--observe-host"}


def joined_lines(path: Path) -> list[str]:
    """The file's lines with backslash continuations joined and comments dropped."""
    text = re.sub(r"\\\n", " ", path.read_text())
    return [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]


def unit_command() -> list[str]:
    """The unit's ExecStart after `bootstrap`, with PUBLIC_IP from its EnvironmentFile."""
    (line,) = [line for line in joined_lines(KIT / "p2p-diloco-bootstrap.service") if line.startswith("ExecStart=")]
    words = shlex.split(line.removeprefix("ExecStart=").replace("${PUBLIC_IP}", PUBLIC_IP))
    assert words[0].endswith("/p2p-diloco") and words[1] == "bootstrap", words[:2]
    return words[2:]


def image_command() -> list[str]:
    """The container's command after `bootstrap` (entrypoint.sh), with PUBLIC_IP set."""
    (line,) = [line for line in joined_lines(KIT / "entrypoint.sh") if line.startswith("exec ")]
    words = shlex.split(line.replace("$PUBLIC_IP", PUBLIC_IP))
    assert words[:3] == ["exec", "p2p-diloco", "bootstrap"] and words[-1] == "$@", words
    return words[3:-1]


def bootstrap_parser() -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["bootstrap"]


def documented_options() -> set[str]:
    """What `p2p-diloco bootstrap --help` lists."""
    return {o for a in bootstrap_parser()._actions if a.help != argparse.SUPPRESS for o in a.option_strings}


def without(words: list[str], options: set[str]) -> list[str]:
    """`words` less each of `options` and the value after it."""
    out, skip = [], False
    for word in words:
        if not skip and word in options:
            skip = True
        elif skip:
            skip = False
        else:
            out.append(word)
    return out


def options_in(words: list[str]) -> set[str]:
    return {w for w in words if w.startswith("--")}


COMMANDS = {"the systemd unit": unit_command, "the image": image_command}


@pytest.mark.parametrize("where", COMMANDS)
def test_the_kit_passes_only_options_that_bootstrap_documents(where):
    words = COMMANDS[where]()
    assert options_in(words) - PENDING <= documented_options(), where
    args = bootstrap_parser().parse_args(without(words, PENDING))
    assert (args.port, args.announce) == (31337, PUBLIC_IP), where


@pytest.mark.parametrize("where", COMMANDS)
def test_the_kit_serves_the_observer_with_flags_that_bootstrap_documents(where):
    missing = sorted(PENDING - documented_options())
    if missing:
        pytest.xfail(f"pending: `p2p-diloco bootstrap {' '.join(missing)}` (the observer) is not in the CLI yet")
    words = COMMANDS[where]()
    assert "--observe-port" in options_in(words), where
    args = bootstrap_parser().parse_args(words)
    assert args.observe_port == 8080, where


def unit_settings() -> dict[str, list[str]]:
    settings: dict[str, list[str]] = {}
    for line in joined_lines(KIT / "p2p-diloco-bootstrap.service"):
        if "=" in line:
            key, value = line.split("=", 1)
            settings.setdefault(key, []).append(value)
    return settings


def test_the_unit_signals_the_node_alone_and_keeps_its_key_where_it_may_write():
    unit = unit_settings()
    assert unit["KillMode"] == ["mixed"] and unit["KillSignal"] == ["SIGTERM"]
    assert unit["StateDirectory"] == ["p2p-diloco"] and unit["ReadWritePaths"] == ["/var/lib/p2p-diloco"]
    # ProtectSystem=strict leaves nothing else writable: a key elsewhere could not be made on the first start.
    assert unit["ProtectSystem"] == ["strict"] and unit["PrivateTmp"] == ["yes"]
    assert bootstrap_parser().parse_args(without(unit_command(), PENDING)).identity.startswith("/var/lib/p2p-diloco/")
    assert unit["EnvironmentFile"] == ["/etc/p2p-diloco/bootstrap.env"] and "User" in unit


def dockerfile() -> list[tuple[str, list[str]]]:
    """(INSTRUCTION, its words) for each instruction of the Dockerfile; exec forms (JSON) decoded."""
    out = []
    for line in joined_lines(KIT / "Dockerfile"):
        instruction, _, rest = line.partition(" ")
        if instruction.upper() == "HEALTHCHECK":
            flags, _, command = rest.partition(" CMD ")
            out.append(("HEALTHCHECK", [*flags.split(), "CMD", *words_of(command)]))
        else:
            out.append((instruction.upper(), words_of(rest)))
    return out


def words_of(arguments: str) -> list[str]:
    arguments = arguments.strip()
    return json.loads(arguments) if arguments.startswith("[") else shlex.split(arguments)


def healthcheck_command() -> list[str]:
    words = dict(dockerfile())["HEALTHCHECK"]
    return words[words.index("CMD") + 1 :]


def copies() -> dict[str, str]:
    """{source in the build context: its path in the image} for every COPY."""
    out = {}
    for instruction, words in dockerfile():
        if instruction == "COPY":
            assert not any(w.startswith("--from") for w in words), "a COPY from another stage: teach this test"
            *sources, dest = [w for w in words if not w.startswith("--")]
            for source in sources:
                out[source] = dest + Path(source).name if dest.endswith("/") else dest
    return out


def dockerignore() -> list[str]:
    lines = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()]
    patterns = [line for line in lines if line and not line.startswith("#")]
    assert not [p for p in patterns if p.startswith("!")], "exceptions in .dockerignore: teach ignored() them"
    return patterns


def ignored(path: str) -> bool:
    """Whether .dockerignore keeps `path` (or a folder above it) out of the build context."""
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    for pattern in dockerignore():
        if pattern.startswith("**/"):
            tails = {"/".join(p.split("/")[j:]) for p in prefixes for j in range(p.count("/") + 1)}
            if any(fnmatch(tail, pattern[3:]) for tail in tails):
                return True
        elif any(fnmatch(prefix, pattern) for prefix in prefixes):
            return True
    return False


def test_every_path_the_dockerfile_copies_is_in_the_build_context():
    assert copies(), "the Dockerfile copies nothing?"
    for source in copies():
        assert (ROOT / source).exists(), source
        assert not ignored(source), f"{source} is left out by .dockerignore"


def test_the_build_context_holds_the_whole_package_and_no_key():
    package = [str(p.relative_to(ROOT)) for p in (ROOT / "p2p_diloco").rglob("*") if p.is_file()]
    kept = [p for p in package if "__pycache__" not in p]
    assert kept and not [p for p in kept if ignored(p)]
    for path in [
        "bootstrap.key",
        "runs/default/identity.key",
        "bootstrap/bootstrap.key",
        ".venv/bin/python",
        ".git/HEAD",
    ]:
        assert ignored(path), path


@pytest.mark.timeout(120)
def test_the_package_the_image_installs_holds_every_file_it_reads(tmp_path):
    # The image runs `pip install /src`: a wheel, not the source tree, so a file the package reads
    # (the observer's dashboard page) must be declared as package data or the node fails at start.
    pytest.importorskip("setuptools", reason="building the wheel offline needs setuptools in the venv")
    for source, dest in copies().items():
        if dest.startswith("/src/"):
            copy = shutil.copytree if (ROOT / source).is_dir() else shutil.copy
            (tmp_path / dest.removeprefix("/src/")).parent.mkdir(parents=True, exist_ok=True)
            copy(ROOT / source, tmp_path / dest.removeprefix("/src/"))
    build = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", "dist", "."]
    subprocess.run(build, cwd=tmp_path, check=True, capture_output=True, timeout=100)
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    packaged = set(zipfile.ZipFile(wheel).namelist())
    package = [p.relative_to(ROOT).as_posix() for p in (ROOT / "p2p_diloco").rglob("*") if p.is_file()]
    missing = [p for p in package if "__pycache__" not in p and p not in packaged]
    assert not missing, f"add them to [tool.setuptools.package-data] in pyproject.toml: {missing}"


def test_the_image_keeps_its_key_in_the_data_volume_and_checks_its_health_with_the_script():
    found = dict(dockerfile())
    assert found["VOLUME"] == ["/data"] and set(found["EXPOSE"]) == {"31337", "8080"}
    assert found["USER"] and found["USER"] != ["root"]
    assert bootstrap_parser().parse_args(without(image_command(), PENDING)).identity.startswith("/data/")
    assert copies()["bootstrap/healthcheck.py"] in healthcheck_command()
    assert copies()["bootstrap/entrypoint.sh"] in found["ENTRYPOINT"]


def compose_service() -> dict:
    """The bootstrap service of compose.yaml, parsed if PyYAML is there; else the essential keys by text."""
    text = (KIT / "compose.yaml").read_text()
    try:
        import yaml
    except ImportError:
        for fragment in ["stop_signal: SIGTERM", "stop_grace_period: 30s", "healthcheck:", ":/data", "PUBLIC_IP"]:
            assert fragment in text, fragment
        pytest.skip("PyYAML is not installed: compose.yaml checked by text only")
    return yaml.safe_load(text)["services"]["bootstrap"]


def test_compose_runs_the_image_with_its_ports_key_config_and_clean_stop():
    service = compose_service()
    assert (KIT / service["build"]["context"] / service["build"]["dockerfile"]).resolve() == KIT / "Dockerfile"
    assert "31337:31337/tcp" in service["ports"] and "127.0.0.1:8080:8080/tcp" in service["ports"]
    volumes = service["volumes"]
    assert [v for v in volumes if v.endswith(":/data")] and [v for v in volumes if v.endswith(":/config/run.toml:ro")]
    assert "PUBLIC_IP" in service["environment"] and service["restart"]
    assert (service["stop_signal"], service["stop_grace_period"], service["init"]) == ("SIGTERM", "30s", True)


def test_compose_checks_health_with_the_same_script_as_the_image():
    test = compose_service()["healthcheck"]["test"]
    assert test[0] == "CMD" and test[1:] == healthcheck_command()


class Observer(ThreadingHTTPServer):
    """A stand-in for the node's observer on 127.0.0.1: /healthz answers `self.answer`."""

    answer = (200, b"ok\n")


class Healthz(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (http.server's name)
        status, body = self.server.answer if self.path == "/healthz" else (404, b"not found\n")
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format, *args):  # noqa: A002 (http.server's name)
        pass


@pytest.fixture
def observer():
    server = Observer(("127.0.0.1", 0), Healthz)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
    thread.join(timeout=10)


def healthcheck(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run the script as Docker and cron do: a process of its own, its exit code and stderr."""
    return subprocess.run(
        [sys.executable, str(HEALTHCHECK), *args], capture_output=True, text=True, timeout=30, env=env or {}
    )


def test_healthcheck_follows_the_node_from_ok_to_unhealthy(observer):
    port = str(observer.server_address[1])
    ok = healthcheck("--port", port)
    assert (ok.returncode, ok.stdout, ok.stderr) == (0, "", "")
    observer.answer = (503, b"unhealthy: the DHT process is not alive\n")
    down = healthcheck("--host", "127.0.0.1", "--port", port)
    assert down.returncode == 1 and down.stdout == ""
    (line,) = down.stderr.splitlines()
    assert f"127.0.0.1:{port}/healthz answered 503: unhealthy: the DHT process is not alive" in line


def test_healthcheck_takes_the_observer_from_the_environment_and_no_proxy(observer):
    env = {"P2P_DILOCO_OBSERVE_HOST": "127.0.0.1", "P2P_DILOCO_OBSERVE_PORT": str(observer.server_address[1])}
    dead_proxy = {"http_proxy": "http://127.0.0.1:9", "HTTP_PROXY": "http://127.0.0.1:9", "no_proxy": ""}
    assert healthcheck(env={**env, **dead_proxy}).returncode == 0


def test_healthcheck_on_a_closed_port_says_unreachable_on_one_line():
    with socket.socket() as probe:  # a port that was free a moment ago: nothing listens there now
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    result = healthcheck("--port", str(port))
    assert result.returncode == 1
    (line,) = result.stderr.splitlines()
    assert f"127.0.0.1:{port}/healthz is unreachable" in line


def test_healthcheck_on_an_observer_that_never_answers_gives_up_at_its_timeout():
    with socket.socket() as hung:  # listens, so connecting works, but never accepts nor answers
        hung.bind(("127.0.0.1", 0))
        hung.listen(1)
        started = time.monotonic()
        result = healthcheck("--port", str(hung.getsockname()[1]), "--timeout", "0.5")
        elapsed = time.monotonic() - started
    assert result.returncode == 1 and elapsed < 10
    (line,) = result.stderr.splitlines()
    assert "gave no answer within 0.5 s" in line


def test_healthcheck_needs_only_the_standard_library():
    tree = ast.parse(HEALTHCHECK.read_text())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert {name.split(".")[0] for name in names} <= set(sys.stdlib_module_names) | {"__future__"}


# Lines the operator's guide quotes, and the source that prints each (a fragment of its literal text).
QUOTED = {
    "bootstrap node up; give peers this line (any of the addresses works):": "p2p_diloco/cli.py",
    "[bootstrap] ": "p2p_diloco/swarm/bootstrap.py",
    " peers in the routing table; run ": "p2p_diloco/swarm/bootstrap.py",
    "no round records yet": "p2p_diloco/swarm/bootstrap.py",
    "peers in the routing table (pass --config RUN_TOML to see the run's rounds)": ("p2p_diloco/swarm/bootstrap.py"),
    "stopping the bootstrap node": "p2p_diloco/cli.py",
    "(again to stop now)": "p2p_diloco/cli.py",
    "stopped during start-up": "p2p_diloco/cli.py",
    "no certificate of it seen yet": "p2p_diloco/swarm/trust/gate.py",
    "the organiser revoked peer ": "p2p_diloco/swarm/trust/gate.py",
    "stop what uses it or choose ": "p2p_diloco/swarm/transport/node.py",
    " is not a private key; it is this bootstrap node's identity": "p2p_diloco/swarm/transport/identity.py",
    "restore the file from its backup and pass it with": "p2p_diloco/swarm/transport/identity.py",
}


def test_the_operator_guide_quotes_lines_the_node_prints():
    guide = " ".join((KIT / "README.md").read_text().split())
    for fragment, source in QUOTED.items():
        assert fragment in (ROOT / source).read_text(), (
            f"{source} no longer prints {fragment!r}: update bootstrap/README.md"
        )
        assert " ".join(fragment.split()) in guide, fragment


def test_the_nodes_status_line_counts_only_peers_whose_heartbeat_is_fresh():
    # A round record lives 90 s after its peer stopped: the node said "round 20: 3 peers" of a run
    # that had ended, with an empty routing table.
    from p2p_diloco.protocol.budget import ProgressReport
    from p2p_diloco.protocol.network import RoundRecord
    from p2p_diloco.swarm.bootstrap import rounds_seen

    found = {p: RoundRecord(p, r, "d", 0, 0.0) for p, r in (("a", 20), ("b", 20), ("c", 19), ("d", 20))}
    now = 1000.0
    reports = [
        ProgressReport("a", 20, 0, 0.0, now - 1),
        ProgressReport("b", 20, 0, 0.0, now - 9),
        ProgressReport("c", 19, 0, 0.0, now - 2),
    ]
    reports.append(ProgressReport("d", 20, 0, 0.0, now - 11))  # d stopped 11 s ago
    assert rounds_seen(found, reports, now) == "round 19: 1 peer, round 20: 2 peers; 1 stopped (no heartbeat for 10 s)"
    assert rounds_seen(found, [], now) == "4 stopped (no heartbeat for 10 s)"
    assert rounds_seen({}, [], now) == "no round records yet"


def test_the_image_installs_the_package_s_own_dependencies_less_the_training_stack():
    import tomllib

    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    lines = [line for line in (KIT / "requirements.txt").read_text().splitlines() if line and line[0] != "#"]
    name = re.compile(r"[A-Za-z0-9_.-]+")
    left_out = {name.match(d).group(0) for d in declared} - {name.match(line).group(0) for line in lines}
    assert left_out == {"torch", "transformers", "datasets", "safetensors"}  # torch: the CPU build, first
    assert set(lines) <= set(declared), set(lines) - set(declared)  # the same pins
    dockerfile = joined_lines(KIT / "Dockerfile")
    assert "RUN pip install -r /src/bootstrap/requirements.txt" in dockerfile
    assert "RUN pip install --no-deps /src && rm -rf /src" in dockerfile


OBSERVE_EVERY_5 = ["--observe-port", "0", "--observe-eval-every", "5"]


@pytest.mark.timeout(120)
def test_a_node_and_its_observer_run_without_the_training_stack_and_say_why_there_is_no_held_out_loss(tmp_path):
    from p2p_diloco import config

    toml = tmp_path / "run.toml"
    config.save(config.load(None, {"swarm.hole_punching": "true"}), toml)  # a relay too
    options = ["--identity", str(tmp_path / "b.key"), "--host", "127.0.0.1", "--port", "0", "--config", str(toml)]
    options += ["--metrics-port", "0"]
    node = subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("node_only.py")), "bootstrap", *options, *OBSERVE_EVERY_5],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        cwd=ROOT,
    )
    try:
        lines = [node.stdout.readline() for _ in range(4)]
        assert lines[0].startswith("bootstrap node up") and "--initial-peers /ip4/127.0.0.1/tcp/" in lines[1], lines
        # its p2pd's own metrics (--metrics-port), the relay's counters among them
        metrics = re.fullmatch(r"p2pd metrics: (http://127\.0\.0\.1:\d+/metrics)\n", lines[2]).group(1)
        with urllib.request.urlopen(metrics, timeout=10) as answer:
            assert "\nlibp2p_relaysvc_data_transferred_bytes_total 0\n" in answer.read().decode()
        url = re.search(r"dashboard (http://\S+/)", lines[3]).group(1)
        with urllib.request.urlopen(url + "api/v1/run", timeout=10) as answer:
            run = json.loads(answer.read())["run"]
        assert run["eval_off"].startswith("held-out loss off: this install has no training stack (transformers)")
    finally:
        node.send_signal(signal.SIGTERM)
        _, err = node.communicate(timeout=60)
    assert node.returncode == 0 and "Traceback" not in err, err
    assert err.count("held-out loss off: this install has no training stack") == 1, err
