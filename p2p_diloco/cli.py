"""`p2p-diloco`: turns argv into a config and calls one function. The only module that prints."""

from __future__ import annotations

import argparse
import difflib
import errno
import os
import signal
import sys
import threading
from collections.abc import Sequence
from typing import Any, NoReturn

from p2p_diloco import __version__
from p2p_diloco import config as config_mod
from p2p_diloco.errors import ConfigError, P2PDilocoError, SwarmError, WriteError

EPILOG = "Every config field is also an option: --section.key VALUE (see `p2p-diloco config --reference`)."


def _add_config_options(parser: argparse.ArgumentParser) -> None:
    """One option per config field, named --section.key, documented from the field itself."""
    parser.add_argument("--config", metavar="RUN_TOML", help="run config file (TOML); the options below override it")
    groups = {section: parser.add_argument_group(f"[{section}]") for section in config_mod.SECTIONS}
    for section, key, typ, default, meta in config_mod.field_specs():
        kind = "local" if meta["local"] else "shared"
        groups[section].add_argument(
            f"--{section}.{key}",
            dest=f"{section}.{key}",
            metavar=_metavar(typ),
            help=f"{meta['doc']} (default: {config_mod.format_value(default)}; {kind})".replace("%", "%%"),
        )


def _metavar(typ: type) -> str:
    if typ is bool:
        return "BOOL"
    if config_mod.choices(typ):
        return "|".join(config_mod.choices(typ))
    return "A,B,..." if typ not in (int, float, str) else typ.__name__.upper()


_Commands = argparse._SubParsersAction  # what add_subparsers returns; add_parser adds one command


class _Parser(argparse.ArgumentParser):
    """argparse without prefix matching (`--inner.step` is not `--inner.steps`), and with the
    nearest known option suggested for an unknown one."""

    def __init__(self, *args: Any, **kwargs: Any):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        """argparse's error, with the nearest known option for an unknown one (never for a known
        option that is missing or misused: "required: --config (did you mean --config?)")."""
        known = self._every_option()
        unknown = [word.split("=")[0].rstrip(",:") for word in message.split() if word.startswith("--")]
        for option in (o for o in unknown if o not in known):
            near = difflib.get_close_matches(option, sorted(known), n=1, cutoff=0.75)
            if near:
                message += f" (did you mean {near[0]}?)"
        super().error(message)

    def _every_option(self) -> set[str]:
        found = {o for action in self._actions for o in action.option_strings}
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    found |= sub._every_option() if isinstance(sub, _Parser) else set()
        return found


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="p2p-diloco", description="Peer-to-peer, serverless DiLoCo training of language models.")
    parser.add_argument("--version", action="version", version=f"p2p-diloco {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    # the order of the commands is the order `p2p-diloco --help` lists them in
    _add_peer_command(sub)
    _add_bootstrap_command(sub)
    _add_demo_command(sub)
    _add_baseline_command(sub)
    _add_config_command(sub)
    _add_export_command(sub)
    _add_observe_commands(sub)
    _add_id_command(sub)
    _add_check_network_command(sub)
    _add_admission_command(sub)
    return parser


def _add_observe_commands(sub: _Commands) -> None:
    obs = sub.add_parser("observe", help="serve a run's live dashboard, JSON API and Prometheus metrics (read-only)")
    _add_run_source(obs)
    obs.add_argument("--host", default="127.0.0.1", help="address to serve on (0.0.0.0: every interface)")
    obs.add_argument("--port", type=int, default=8080, help="TCP port to serve on (0: any free port)")
    obs.add_argument("--identity", help="key file for a stable observer id (default: a new one each start)")
    obs.add_argument(
        "--eval-every",
        type=_rounds,
        default=10,
        metavar="ROUNDS",
        help="download the agreed state every ROUNDS rounds, verify it and compute its held-out loss "
        "(0: never; default: %(default)s)",
    )
    obs.add_argument(
        "--certificate", metavar="FILE", help="a certified run's certificate for --identity (to download states)"
    )
    obs.add_argument(
        "--poll-s",
        type=_seconds,
        default=OBSERVE_POLL_S,
        metavar="SECONDS",
        help="read the run's records every SECONDS seconds: each read is DHT requests that the run's nodes "
        "serve (docs/observer.md; default: %(default)s)",
    )
    status = sub.add_parser("status", help="print a run's swarm at a glance, and one peer's rounds")
    _add_run_source(status, required=False)
    status.add_argument(
        "--peer", metavar="ID", help="also this peer's rounds: counted or not, and why (an id or its end)"
    )
    status.add_argument("--run-dir", metavar="DIR", help="also the rounds of the peer whose run dir this is")
    status.add_argument("--wait", type=float, default=5.0, metavar="SECONDS", help="read the swarm this long")


# The observer's poll interval: it keeps the observer's DHT requests under 5 % of a 3-peer run's
# (1 s would not; see docs/benchmarks.md, Observer load). The dashboard redraws every 2 s; a peer
# shows offline after 10 s without news (run_view.ONLINE_S).
OBSERVE_POLL_S = 5.0
PRIVATE_EXIT = 3  # check-network: others cannot dial this machine


def _seconds(text: str) -> float:
    """A time in seconds, more than 0."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"a number of seconds, more than 0, not {text!r}")
    return value


def _rounds(text: str) -> int:
    """A number of rounds, 0 or more (0: never)."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"a number of rounds, 0 or more (0: never), not {text!r}")
    return value


def _port(text: str) -> int:
    """A TCP port, 0 to 65535 (0: a free one)."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a TCP port, 0 to 65535 (0: a free one), not {text!r}")
    return value


def _add_run_source(parser: argparse.ArgumentParser, required: bool = True) -> None:
    more = "" if required else " (default: the --run-dir's config.toml and its initial peers)"
    parser.add_argument("--config", required=required, metavar="RUN_TOML", help="the run's config" + more)
    parser.add_argument(
        "--initial-peers", nargs="+", required=required, metavar="MADDR", help="any node of the run" + more
    )


def _add_id_command(sub: _Commands) -> None:
    ident = sub.add_parser("id", help="print this peer's id (what a volunteer sends the organiser of a certified run)")
    ident.add_argument(
        "--run.dir", dest="run_dir", default="runs/default", help="the peer's run dir (default: %(default)s)"
    )
    ident.add_argument("--identity", help="the peer's identity key file (default: identity.key in the run dir)")


def _add_check_network_command(sub: _Commands) -> None:
    check = sub.add_parser(
        "check-network",
        help="ask a run's entry nodes whether they can dial this machine: prints its tier (exit 0 public, 3 private)",
    )
    check.add_argument("--initial-peers", nargs="+", required=True, metavar="MADDR", help="the run's entry nodes")
    check.add_argument("--host", default="0.0.0.0", help="IP address the peer will listen on (default: %(default)s)")
    check.add_argument("--port", type=int, default=0, help="TCP port the peer will listen on (0: any)")
    check.add_argument(
        "--upnp", action="store_true", help="ask the home router to map the port first (swarm.upnp; probes the LAN)"
    )


def _add_admission_command(sub: _Commands) -> None:
    adm = sub.add_parser("admission", help="the organiser's run key and certificates (certified runs)")
    what = adm.add_subparsers(dest="action", required=True, metavar="ACTION")
    keygen = what.add_parser("keygen", help="make the run key; prints the line for run.toml")
    keygen.add_argument(
        "--out", default="run.key", help="the private run key file (never overwritten; keep it private)"
    )
    admit = what.add_parser("admit", help="certify a volunteer's peer id for this run")
    admit.add_argument("--key", default="run.key", help="the run key file")
    admit.add_argument("--config", required=True, metavar="RUN_TOML", help="the run's config (its run id and key)")
    admit.add_argument("--peer-id", required=True, help="the id the volunteer sent (p2p-diloco id)")
    admit.add_argument("--name", required=True, help="who this is, for the organiser's own records")
    admit.add_argument("--days", type=float, default=30.0, help="how long the certificate is valid")
    admit.add_argument("--out", help="certificate file to write (default: certs/NAME.cert)")
    listing = what.add_parser("list", help="list the certificates in a folder, checked against the run config")
    listing.add_argument("folder", nargs="?", default="certs")
    listing.add_argument("--config", required=True, metavar="RUN_TOML", help="the run's config")
    revoke = what.add_parser("revoke", help="revoke a peer while the run goes on (through the run's DHT)")
    revoke.add_argument("--key", default="run.key", help="the run key file")
    revoke.add_argument("--config", required=True, metavar="RUN_TOML", help="the run's config")
    revoke.add_argument("--peer-id", required=True, help="the peer to revoke (as in its certificate)")
    revoke.add_argument("--reason", default="", help="one line, shown to the peer and in every peer's log")
    revoke.add_argument("--folder", default="certs", help="certificates folder; the revocation goes to its revoked/")
    revoke.add_argument("--initial-peers", nargs="+", required=True, metavar="MADDR", help="any peer of the run")
    revoke.add_argument("--wait", type=float, default=60.0, metavar="SECONDS", help="wait this long for peers")
    convictions = what.add_parser(
        "convictions", help="who the run's peers convicted in audits, and who says so (through the run's DHT)"
    )
    convictions.add_argument("--config", required=True, metavar="RUN_TOML", help="the run's config")
    convictions.add_argument("--initial-peers", nargs="+", required=True, metavar="MADDR", help="any peer of the run")
    convictions.add_argument("--wait", type=float, default=20.0, metavar="SECONDS", help="read for this long at most")
    sign = what.add_parser("sign-config", help="sign the run config; prints the line for its [admission] section")
    sign.add_argument("--key", default="run.key", help="the run key file")
    sign.add_argument("--config", required=True, metavar="RUN_TOML", help="the run's config")


def _add_peer_command(sub: _Commands) -> None:
    peer = sub.add_parser("peer", help="train: alone, or as one peer of a swarm (--initial-peers)", epilog=EPILOG)
    peer.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --run.dir")
    peer.add_argument("--initial-peers", nargs="+", metavar="MADDR", help="same as --swarm.initial_peers")
    peer.add_argument(
        "--nproc", type=int, metavar="N", help="train on N GPUs, one process each (same as --run.nproc); not torchrun"
    )
    _add_config_options(peer)


def _add_bootstrap_command(sub: _Commands) -> None:
    boot = sub.add_parser("bootstrap", help="run a bootstrap node: a stable entry point into the swarm")
    boot.add_argument(
        "--identity",
        default="bootstrap.key",
        help="private key file fixing the node's address (made on first start; keep it private)",
    )
    boot.add_argument("--host", default="0.0.0.0", help="IP address to listen on")
    boot.add_argument("--port", type=int, default=31337, help="TCP port to listen on")
    boot.add_argument(
        "--announce", default="", metavar="PUBLIC_IP", help="public IP to announce, if it differs from --host"
    )
    boot.add_argument(
        "--initial-peers",
        nargs="+",
        metavar="MADDR",
        help="other entry nodes (or peers) of the swarm: entry nodes that know each other chain, and any one lets a "
        "volunteer in",
    )
    boot.add_argument(
        "--config",
        metavar="RUN_TOML",
        help="the run's config: report the rounds its peers are at, and remember where they listen (a restarted node "
        "finds them again)",
    )
    boot.add_argument(
        "--report-every", type=float, default=30.0, metavar="SECONDS", help="log the swarm status this often"
    )
    boot.add_argument(
        "--metrics-port",
        type=_port,
        metavar="PORT",
        help="serve p2pd's Prometheus metrics (libp2p's connections, streams and resources) on 127.0.0.1:PORT",
    )
    _add_bootstrap_observer_options(boot)


def _add_bootstrap_observer_options(boot: argparse.ArgumentParser) -> None:
    boot.add_argument(
        "--observe-port", type=int, metavar="PORT", help="also serve the run's dashboard, /metrics and /healthz here"
    )
    boot.add_argument("--observe-host", default="127.0.0.1", help="address for --observe-port (default: %(default)s)")
    boot.add_argument(
        "--observe-poll-s",
        type=_seconds,
        default=OBSERVE_POLL_S,
        metavar="SECONDS",
        help="with --observe-port: read the run's records this often, as `observe --poll-s` (default: %(default)s)",
    )
    boot.add_argument(
        "--certificate",
        metavar="FILE",
        help="certified runs: the organiser's certificate for this node's peer id (admission admit), so that peers "
        "serve its observer their state for --observe-eval-every",
    )
    boot.add_argument(
        "--observe-eval-every",
        type=_rounds,
        default=0,
        metavar="ROUNDS",
        help="with --observe-port: also the held-out loss of the agreed state every ROUNDS rounds, as "
        "`observe --eval-every` (needs the run's data here; default: never)",
    )


def _add_demo_command(sub: _Commands) -> None:
    demo = sub.add_parser("demo", help="a bootstrap node and N peers on 127.0.0.1, one combined view")
    demo.add_argument("--peers", type=int, default=3, help="number of peer processes")
    demo.add_argument("--rounds", type=int, default=10, help="rounds to train")
    demo.add_argument(
        "--dir",
        default="runs/demo",
        help="folder for the peers' run dirs and logs: a new or empty one, or a previous demo's (its files are "
        "replaced); any other folder is refused, nothing of yours is deleted",
    )


def _add_baseline_command(sub: _Commands) -> None:
    base = sub.add_parser(
        "baseline", help="the synchronous reference: K local workers averaging gradients every step", epilog=EPILOG
    )
    base.add_argument(
        "--workers",
        type=int,
        default=1,
        help="data-parallel workers (torch.distributed, gloo); 1 = the single-worker baseline",
    )
    _add_config_options(base)


def _add_config_command(sub: _Commands) -> None:
    show = sub.add_parser("config", help="print the resolved config and its fingerprint", epilog=EPILOG)
    show.add_argument("--reference", action="store_true", help="print every field as a Markdown table instead")
    _add_config_options(show)


def _add_export_command(sub: _Commands) -> None:
    export = sub.add_parser(
        "export",
        help="write a run's theta as a transformers model folder, with a model card",
        usage="p2p-diloco export RUN_DIR OUT [--round R] [options]\n"
        "       p2p-diloco export OUT --config RUN_TOML --initial-peers MADDR [MADDR ...] [options]",
        description="From a peer's run dir (its latest or --round checkpoint, verified), or with --initial-peers "
        "from the swarm: the newest state the run's peers agreed on, downloaded from one of them and verified "
        "against the digest they published (no training peer needed).",
    )
    export.add_argument("paths", nargs="+", metavar="[RUN_DIR] OUT", help="a peer's run dir, and the new folder")
    export.add_argument("--round", type=int, help="export this round's checkpoint instead of the latest")
    export.add_argument("--config", metavar="RUN_TOML", help="with --initial-peers: the run's config")
    export.add_argument(
        "--initial-peers", nargs="+", metavar="MADDR", help="download the agreed state from the run's swarm"
    )
    export.add_argument(
        "--identity", metavar="KEY", help="with --initial-peers, in a certified run: a key the organiser certified"
    )
    export.add_argument(
        "--certificate",
        metavar="FILE",
        help="... and its certificate (peers serve their state to admitted askers only)",
    )
    export.add_argument(
        "--wait",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="with --initial-peers: give up after this long (default: %(default)s)",
    )
    export.add_argument(
        "--contributors",
        metavar="FILE",
        help="the JSON the run's observer serves at /api/v1/run: the model card lists its contributors",
    )
    export.add_argument(
        "--license",
        metavar="ID",
        help="the licence the model card states, as the Hub names them (apache-2.0, mit, cc-by-4.0, other); "
        "default: none stated",
    )
    export.add_argument(
        "--push-to-hub",
        metavar="REPO",
        help="then upload the folder to this Hugging Face Hub repo (user/name, created if missing) on "
        "$HF_ENDPOINT or huggingface.co, with the token of HF_TOKEN or `hf auth login`",
    )


def config_from_args(args: argparse.Namespace) -> config_mod.Config:
    overrides = {k: v for k, v in vars(args).items() if "." in k and v is not None}
    if getattr(args, "initial_peers", None):
        overrides["swarm.initial_peers"] = ",".join(args.initial_peers)
    if getattr(args, "nproc", None) is not None:
        overrides["run.nproc"] = str(args.nproc)
    return config_mod.load(args.config, overrides)


def cmd_peer(args: argparse.Namespace) -> int:
    from p2p_diloco.peer import Peer
    from p2p_diloco.train.metrics import setup_logging

    cfg = config_from_args(args)
    setup_logging(cfg.log.level)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # torchrun would start N peers sharing one run dir; a peer starts its own ranks.
        raise ConfigError("a peer starts its own processes: run `p2p-diloco peer --nproc N`, not under torchrun")
    if args.config is None:
        print(
            f"no --config given: run {cfg.run.run_id!r} with the built-in defaults (model preset {cfg.model.preset}, "
            f"{cfg.run.rounds} rounds); to join an organiser's run, pass --config with its run.toml",
            file=sys.stderr,
        )
    stop, running = threading.Event(), threading.Event()
    _install_stop_handlers(stop, running=running)  # before Peer(): a signal during start-up stops it too
    try:
        peer = Peer(cfg, resume=args.resume)
    except KeyboardInterrupt:
        print(f"stopped during start-up: no round was trained; {_checkpoint_line(cfg)}", file=sys.stderr)
        return 0
    running.set()
    try:
        peer.run(stop)
    except KeyboardInterrupt:
        print(f"stopped at once: the partial round was discarded; {_checkpoint_line(cfg)}", file=sys.stderr)
        return 130
    except SwarmError as e:  # the swarm stopped it (no public peer left, a catch-up failed): where to go on from
        e.then = _checkpoint_line(cfg)
        raise
    finally:
        peer.close()
    return 0


def _checkpoint_line(cfg: config_mod.Config) -> str:
    """What a stopped peer leaves to resume from: only a checkpoint that is on disk."""
    from p2p_diloco.train import checkpoint

    latest = checkpoint.latest(cfg.run.dir)
    if latest is None:
        return f"no checkpoint in {cfg.run.dir}"
    return f"the checkpoint of round {checkpoint.round_of(latest)} is on disk, continue with --resume"


def _install_stop_handlers(
    stop: threading.Event, what: str = "stopping after this inner step", running: threading.Event | None = None
) -> None:
    """First Ctrl+C / SIGTERM: a clean stop (for a peer: after the current inner step, the last
    round's checkpoint is on disk). A second one, or one before `running` is set (start-up, which
    cleans up after itself): KeyboardInterrupt, stop now."""

    def handler(signum: int, frame: object) -> None:
        if stop.is_set() or (running is not None and not running.is_set()):
            raise KeyboardInterrupt
        stop.set()
        print(f"\n{signal.Signals(signum).name}: {what} (again to stop now)", file=sys.stderr)

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)


def cmd_bootstrap(args: argparse.Namespace) -> int:
    from pathlib import Path

    from p2p_diloco.swarm.bootstrap import Bootstrap
    from p2p_diloco.train.metrics import setup_logging

    overrides = {"swarm.host": args.host, "swarm.port": str(args.port), "swarm.announce_host": args.announce}
    if args.initial_peers:
        overrides["swarm.initial_peers"] = ",".join(args.initial_peers)
    if args.certificate:
        overrides["admission.certificate"] = args.certificate
    cfg = config_mod.load(args.config, overrides)
    setup_logging(cfg.log.level)
    stop, running = threading.Event(), threading.Event()
    _install_stop_handlers(stop, "stopping the bootstrap node", running)
    try:
        node = Bootstrap(cfg, Path(args.identity), args.config is not None, args.metrics_port)
    except KeyboardInterrupt:
        print("stopped during start-up", file=sys.stderr)
        return 0
    running.set()
    try:
        print("bootstrap node up; give peers this line (any of the addresses works):")
        print("  --initial-peers " + " ".join(node.initial_peers()), flush=True)
        if node.metrics_port is not None:
            print(f"p2pd metrics: http://127.0.0.1:{node.metrics_port}/metrics", flush=True)
        node.serve(stop, args.report_every, _observatory(cfg, node, args))
    finally:
        node.close()
    return 0


def _observatory(cfg: config_mod.Config, node: Any, args: argparse.Namespace) -> Any:
    """With --observe-port: the observer's view of the node's run, fed by the node's status loop."""
    if args.observe_port is None:
        return None
    from p2p_diloco.observe.service import Observatory, evaluation
    from p2p_diloco.swarm.run_reader import RunReader

    reader = RunReader(cfg, node.run_dht, node.gate)
    observatory = Observatory(cfg, reader.healthy, args.observe_host, args.observe_port)
    observatory.reader, observatory.poll_s = reader, args.observe_poll_s
    fix = f"--certificate FILE, for this node's peer id {node.dht.peer_id}, from the organiser's admission admit"
    observatory.evaluate(evaluation(cfg, reader, args.observe_eval_every, _warn, fix), 1.0)
    print(f"observer: dashboard {observatory.server.url}, Prometheus {observatory.server.url}metrics", flush=True)
    return observatory


def cmd_observe(args: argparse.Namespace) -> int:
    from pathlib import Path

    from p2p_diloco.observe.service import evaluation, observe
    from p2p_diloco.swarm.run_reader import Observer
    from p2p_diloco.train.metrics import setup_logging

    overrides = {"swarm.initial_peers": ",".join(args.initial_peers), "admission.certificate": args.certificate}
    cfg = config_mod.load(args.config, {k: v for k, v in overrides.items() if v is not None})
    setup_logging(cfg.log.level)
    stop, running = threading.Event(), threading.Event()
    _install_stop_handlers(stop, "stopping the observer", running)
    try:
        reader = Observer(cfg, Path(args.identity) if args.identity else None)
    except KeyboardInterrupt:
        print("stopped during start-up", file=sys.stderr)
        return 0
    running.set()
    try:
        evaluate = evaluation(cfg, reader, args.eval_every, _warn)
        observe(cfg, reader.poll, reader.healthy, args.host, args.port, stop, _say, args.poll_s, evaluate)
    finally:
        reader.close()
    return 0


def _say(line: str) -> None:
    print(line, flush=True)


def _warn(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def cmd_status(args: argparse.Namespace) -> int:
    from pathlib import Path

    from p2p_diloco.observe.service import gather, status_lines
    from p2p_diloco.swarm.run_reader import Observer, peer_of_run_dir

    cfg = _status_config(args)
    peer = args.peer or (peer_of_run_dir(Path(args.run_dir)) if args.run_dir else None)
    reader = Observer(cfg)
    try:
        view = gather(cfg, reader.poll, args.wait)
    finally:
        reader.close()
    for line in status_lines(view, peer):
        print(line)
    return 0


def _status_config(args: argparse.Namespace) -> config_mod.Config:
    """The run to read: --config and --initial-peers, or what a peer's --run-dir holds (the config
    it wrote there, with its initial peers)."""
    from pathlib import Path

    config_path = args.config or (str(Path(args.run_dir) / "config.toml") if args.run_dir else None)
    if config_path is None:
        raise ConfigError("status needs --config and --initial-peers, or the --run-dir of a peer of the run")
    if args.config is None and not Path(config_path).is_file():
        raise ConfigError(f"{args.run_dir} holds no config.toml (a peer writes it at start): pass --config")
    overrides = {"swarm.initial_peers": ",".join(args.initial_peers)} if args.initial_peers else {}
    cfg = config_mod.load(config_path, overrides)
    if not cfg.swarm.initial_peers:
        raise ConfigError(f"no initial peers in {config_path}: pass --initial-peers with any node of the run")
    return cfg


def cmd_demo(args: argparse.Namespace) -> int:
    from p2p_diloco.demo import run_demo
    from p2p_diloco.train.metrics import setup_logging

    setup_logging("info")
    stop = threading.Event()
    _install_stop_handlers(stop, "stopping every peer of the demo")
    return run_demo(args.peers, args.rounds, args.dir, stop, emit=lambda line: print(line, flush=True))


def cmd_baseline(args: argparse.Namespace) -> int:
    from p2p_diloco.train import dataparallel

    cfg = config_from_args(args)
    path = dataparallel.run(cfg, args.workers)
    print(f"metrics: {path}")
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    if args.reference:
        print(reference_markdown())
        return 0
    import tomli_w

    cfg = config_from_args(args)
    print(f"# fingerprint {cfg.fingerprint()}")
    print(tomli_w.dumps(cfg.to_dict()), end="")
    return 0


def reference_markdown() -> str:
    """The config reference of the README, generated from the dataclasses."""
    lines = ["| option | default | shared | meaning |", "|---|---|---|---|"]
    for section, key, _, default, meta in config_mod.field_specs():
        shown = config_mod.format_value(default)
        lines.append(f"| `{section}.{key}` | `{shown}` | {'' if meta['local'] else 'yes'} | {meta['doc']} |")
    return "\n".join(lines)


def cmd_export(args: argparse.Namespace) -> int:
    import transformers

    from p2p_diloco.observe.export import check_repo_id, export_run, push_to_hub

    transformers.utils.logging.disable_progress_bar()
    if args.push_to_hub is not None:
        check_repo_id(args.push_to_hub)
    if args.initial_peers:
        out = _export_from_swarm(args)
    else:
        if len(args.paths) != 2:
            raise ConfigError("export needs a peer's RUN_DIR and the new folder OUT (or OUT --initial-peers MADDR)")
        out = export_run(args.paths[0], args.paths[1], args.round, args.contributors, args.push_to_hub, args.license)
    print(
        f"exported to {out} (model card: {out / 'README.md'}); load it with "
        f"AutoModelForCausalLM.from_pretrained({str(out)!r})",
        flush=True,
    )
    if args.push_to_hub is not None:
        print(f"uploaded to {push_to_hub(out, args.push_to_hub)}")
    return 0


def _export_from_swarm(args: argparse.Namespace) -> Any:
    """`export OUT --config RUN_TOML --initial-peers MADDR`: the swarm's newest agreed state."""
    if len(args.paths) != 1 or not args.config or args.round is not None:
        raise ConfigError(
            "with --initial-peers, export takes the new folder OUT and --config RUN_TOML, and no --round "
            "(it exports the newest agreed state): p2p-diloco export OUT --config RUN_TOML --initial-peers MADDR"
        )
    from pathlib import Path

    from p2p_diloco.observe.evaluate import RunModel
    from p2p_diloco.observe.export import export_agreed
    from p2p_diloco.observe.service import fetch_agreed
    from p2p_diloco.swarm.run_reader import Observer

    overrides = {"swarm.initial_peers": ",".join(args.initial_peers), "admission.certificate": args.certificate}
    cfg = config_mod.load(args.config, {k: v for k, v in overrides.items() if v is not None})
    _refuse_an_uncertified_export(cfg, args.identity)
    model = RunModel(cfg)
    reader = Observer(cfg, Path(args.identity) if args.identity else None)
    try:
        client = reader.state_client(model.numel)
        try:
            found = fetch_agreed(cfg, reader.poll, client, model, args.wait)
        finally:
            client.close()
    finally:
        reader.close()
    servers = ", ".join(found.served_by)
    print(f"downloaded the agreed state of round {found.round} (digest {found.digest[:12]}) from {servers}")
    params = model.params(found.state)
    out = args.paths[0]
    return export_agreed(
        cfg, found.round, found.digest, found.served_by, params, out, args.contributors, args.push_to_hub, args.license
    )


def _refuse_an_uncertified_export(cfg: config_mod.Config, identity: str | None) -> None:
    """A certified run's peers serve their state to admitted askers only: an export without a
    certified key would wait out its deadline and blame the run. Say what it needs, at once."""
    if cfg.admission.mode != "certified" or (cfg.admission.certificate and identity):
        return
    raise ConfigError(
        f"run {cfg.run.run_id!r} is certified: its peers serve their state to admitted peers only, so export needs a "
        "key the organiser certified: p2p-diloco export OUT --config RUN_TOML --initial-peers MADDR --identity KEY "
        "--certificate FILE (`p2p-diloco id --identity KEY` prints the id to send the organiser, who runs "
        "`p2p-diloco admission admit`); or export from a peer's run dir: p2p-diloco export RUN_DIR OUT"
    )


def cmd_id(args: argparse.Namespace) -> int:
    from pathlib import Path

    from p2p_diloco.swarm.transport.identity import peer_id_of

    path = Path(args.identity) if args.identity else Path(args.run_dir) / "identity.key"
    print(peer_id_of(path))
    return 0


def cmd_check_network(args: argparse.Namespace) -> int:
    from p2p_diloco.protocol import reachability
    from p2p_diloco.swarm.transport.node import ask_reachability
    from p2p_diloco.train.metrics import setup_logging

    options = {"swarm.host": args.host, "swarm.port": str(args.port), "swarm.upnp": str(args.upnp).lower()}
    cfg = config_mod.load(None, options)
    setup_logging("warning")
    reach = ask_reachability(cfg.swarm, args.initial_peers)
    print(reachability.line(reach))
    return 0 if reach.serves else PRIVATE_EXIT


def cmd_admission(args: argparse.Namespace) -> int:
    from pathlib import Path

    from p2p_diloco.trust import admission

    if args.action == "keygen":
        public = admission.make_run_key(Path(args.out))
        print(f"run key written to {args.out} (keep it private); put this in the run's run.toml:")
        print(f'[admission]\nmode = "certified"\norganiser_key = "{public}"')
        return 0
    cfg = config_mod.load(args.config)
    if args.action == "admit":
        out = Path(args.out) if args.out else Path("certs") / f"{args.name}.cert"
        cert = admission.admit(
            Path(args.key), cfg.run.run_id, cfg.admission.organiser_key, args.peer_id, args.name, args.days, out
        )
        print(
            f"certificate for {cert.name} ({cert.peer_id}) written to {out}; send it to them: they pass it as "
            f"--admission.certificate {out.name}"
        )
        return 0
    if args.action == "revoke":
        return _revoke(args, cfg)
    if args.action == "convictions":
        return _convictions(args, cfg)
    if args.action == "sign-config":
        signed = admission.sign_config(Path(args.key), cfg.run.run_id, cfg.admission.organiser_key, cfg.fingerprint())
        print(f"config {cfg.fingerprint()} of run {cfg.run.run_id!r} signed; put this in the [admission] section:")
        print(f'config_signature = "{signed.signature}"')
        return 0
    for line in admission.listing(Path(args.folder), cfg.run.run_id, cfg.admission.organiser_key):
        print(line)
    return 0


def _revoke(args: argparse.Namespace, cfg: config_mod.Config) -> int:
    from pathlib import Path

    from p2p_diloco.swarm.bootstrap import publish_revocation
    from p2p_diloco.trust import admission

    out = Path(args.folder) / admission.REVOKED_DIR / f"{args.peer_id}.json"
    revocation = admission.revoke(
        Path(args.key), cfg.run.run_id, cfg.admission.organiser_key, args.peer_id, args.reason, out
    )
    reach = config_mod.load(args.config, {"swarm.initial_peers": ",".join(args.initial_peers), "swarm.port": "0"})
    holders = publish_revocation(reach, revocation.to_json(), args.wait)
    if not holders:
        print(
            f"revocation of {args.peer_id} written to {out}, but no peer of run {cfg.run.run_id!r} published it "
            f"again within {args.wait:g} s: is the run up, and --initial-peers right? Run this again."
        )
        return 1
    print(f"revoked {args.peer_id}: {len(holders)} peer(s) of the run hold the revocation now; copy in {out}")
    return 0


def _convictions(args: argparse.Namespace, cfg: config_mod.Config) -> int:
    """Each convicted peer, by how many peers convicted it, with the command that revokes it."""
    from p2p_diloco.swarm.bootstrap import read_convictions

    reach = config_mod.load(args.config, {"swarm.initial_peers": ",".join(args.initial_peers), "swarm.port": "0"})
    found = read_convictions(reach, args.wait)
    if not found:
        print(f"no convictions published in run {cfg.run.run_id!r} (read for up to {args.wait:g} s)")
        return 0
    peers = " ".join(args.initial_peers)
    for accused, by in sorted(found.items(), key=lambda item: (-len(item[1]), item[0])):
        print(f"{accused}: convicted by {len(by)} peer(s): {', '.join(by)}")
        reason = f"convicted in audits by {len(by)} peer(s)"
        print(
            f"  revoke: p2p-diloco admission revoke --config {args.config} --peer-id {accused} "
            f'--reason "{reason}" --initial-peers {peers}'
        )
    return 0


COMMANDS = {
    "peer": cmd_peer,
    "bootstrap": cmd_bootstrap,
    "demo": cmd_demo,
    "baseline": cmd_baseline,
    "config": cmd_config,
    "export": cmd_export,
    "observe": cmd_observe,
    "status": cmd_status,
    "id": cmd_id,
    "check-network": cmd_check_network,
    "admission": cmd_admission,
}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except P2PDilocoError as e:
        print(f"error: {e.line()}" if e.exit_code else e.line(), file=sys.stderr)  # exit 0: an end, not a failure
        return e.exit_code
    except KeyboardInterrupt:  # a second Ctrl+C (commands with a clean stop say more themselves)
        print("interrupted", file=sys.stderr)
        return 130
    except OSError as e:
        full = _full_disk(e)
        if full is None:
            raise
        print(f"error: {full}", file=sys.stderr)
        return full.exit_code


def _full_disk(e: OSError) -> WriteError | None:
    """A full or read-only disk met by a write that does not raise WriteError itself (a peer's id
    file, a node's key): one line with the fix. Other OSErrors keep their traceback: they may be bugs."""
    if e.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EROFS):
        return None
    if e.filename:
        return WriteError.of(e.filename, e)
    # A write that failed at close (a full disk) names no file; it was one of the run dir's.
    return WriteError(f"a write failed ({e.strerror}); free space on the run dir's disk or choose another --run.dir")


if __name__ == "__main__":
    sys.exit(main())
