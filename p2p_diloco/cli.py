"""`p2p-diloco`: turns argv into a config and calls one function. The only module that prints."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from typing import Sequence

from p2p_diloco import config as config_mod
from p2p_diloco.errors import ConfigError, P2PDilocoError

EPILOG = "Every config field is also an option: --section.key VALUE (see `p2p-diloco config --reference`)."


def _add_config_options(parser: argparse.ArgumentParser) -> None:
    """One option per config field, named --section.key, documented from the field itself."""
    parser.add_argument("--config", metavar="RUN_TOML", help="run config file (TOML); the options below override it")
    groups = {section: parser.add_argument_group(f"[{section}]") for section in config_mod.SECTIONS}
    for section, key, typ, default, meta in config_mod.field_specs():
        kind = "local" if meta["local"] else "shared"
        groups[section].add_argument(
            f"--{section}.{key}", dest=f"{section}.{key}", metavar=_metavar(typ),
            help=f"{meta['doc']} (default: {config_mod.format_value(default)}; {kind})".replace("%", "%%"),
        )


def _metavar(typ: type) -> str:
    if typ is bool:
        return "BOOL"
    return "A,B,..." if typ not in (int, float, str) else typ.__name__.upper()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="p2p-diloco", description="Peer-to-peer, serverless DiLoCo training of language models."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    peer = sub.add_parser("peer", help="train: alone, or (soon) as one peer of a swarm", epilog=EPILOG)
    peer.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --run.dir")
    peer.add_argument("--initial-peers", nargs="+", metavar="MADDR", help="same as --swarm.initial_peers")
    _add_config_options(peer)

    show = sub.add_parser("config", help="print the resolved config and its fingerprint", epilog=EPILOG)
    show.add_argument("--reference", action="store_true", help="print every field as a Markdown table instead")
    _add_config_options(show)

    export = sub.add_parser("export", help="write a run's theta as a transformers model folder")
    export.add_argument("run_dir", help="the run dir of a peer (holds checkpoints/)")
    export.add_argument("out", help="new folder for the model (must not exist or be empty)")
    export.add_argument("--round", type=int, help="export this round's checkpoint instead of the latest")
    return parser


def config_from_args(args: argparse.Namespace) -> config_mod.Config:
    overrides = {k: v for k, v in vars(args).items() if "." in k and v is not None}
    if getattr(args, "initial_peers", None):
        overrides["swarm.initial_peers"] = ",".join(args.initial_peers)
    return config_mod.load(args.config, overrides)


def cmd_peer(args: argparse.Namespace) -> int:
    from p2p_diloco.metrics import setup_logging
    from p2p_diloco.peer import Peer

    cfg = config_from_args(args)
    if cfg.swarm.initial_peers:
        raise ConfigError(
            "--initial-peers: joining a swarm is not in this version yet (it trains one peer alone); "
            "drop --initial-peers / swarm.initial_peers to train alone"
        )
    setup_logging(cfg.log.level)
    stop = threading.Event()
    _install_stop_handlers(stop)
    peer = Peer(cfg, resume=args.resume)
    try:
        peer.run(stop)
    finally:
        peer.close()
    return 0


def _install_stop_handlers(stop: threading.Event) -> None:
    """First Ctrl+C / SIGTERM: stop after the current inner step (the last round's checkpoint
    is on disk). A second Ctrl+C: stop at once."""

    def handler(signum: int, frame: object) -> None:
        if stop.is_set():
            raise KeyboardInterrupt
        stop.set()
        print(f"\n{signal.Signals(signum).name}: stopping after this inner step (again to stop now)", file=sys.stderr)

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)


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

    from p2p_diloco.export import export_run

    transformers.utils.logging.disable_progress_bar()
    out = export_run(args.run_dir, args.out, args.round)
    print(f"exported to {out}; load it with AutoModelForCausalLM.from_pretrained({str(out)!r})")
    return 0


COMMANDS = {"peer": cmd_peer, "config": cmd_config, "export": cmd_export}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except P2PDilocoError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("interrupted: the partial round was discarded; the last round's checkpoint is intact", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
