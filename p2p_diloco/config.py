"""Typed run configuration: frozen dataclasses, TOML files, `--section.key=value` overrides.

A config has two kinds of fields. *Shared* fields define the run (model, data, H, optimizers,
run id): every peer of a swarm must hold the same values, and `fingerprint()` hashes them.
*Local* fields describe one peer's machine (its directory, device, micro-batch): they may differ
between peers and are not part of the fingerprint.

Defaults are the paper's (Douillard et al., 2023): inner AdamW lr 4e-4, weight decay 0.1,
1,000 warm-up steps then cosine decay, H = 500, batch 512 x 1,024 tokens; outer Nesterov SGD
with lr 0.7 and momentum 0.9. The profiles in `peers/` scale the run down to a CPU or home GPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import hashlib
import json
import math
import re
import sys
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import tomli_w

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10
    import tomli as tomllib

from p2p_diloco.errors import ConfigError, P2PDilocoError, WriteError
from p2p_diloco.protocol import codecs
from p2p_diloco.trust import robust

# The fields that take one of a fixed set of values; validate() names the choices on a bad value.
Source = Literal["stdlib", "files", "hub"]
ShardBy = Literal["document", "folder", "file"]
Precision = Literal["auto", "fp32", "bf16"]
Overlap = Literal["off", "delayed", "eager"]
ReachabilitySetting = Literal["auto", "public", "private"]
LogLevel = Literal["debug", "info", "warning", "error"]
AdmissionMode = Literal["open", "certified"]
WandbMode = Literal["online", "offline"]


# A Hugging Face Hub repository id (org/name), and the revision a spec may pin after "@": a commit
# hash, a tag or a branch (git ref names; refs/pr/1 too).
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")
REVISION = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)*")


def hub_spec(spec: str) -> tuple[str, str | None]:
    """`org/name@revision` -> (org/name, revision); a spec without "@" -> (spec, None): a name or a
    local path, loaded at the Hub's latest revision or from disk. ConfigError on a malformed pin."""
    if "@" not in spec:
        return spec, None
    name, _, revision = spec.partition("@")
    if not HUB_ID.fullmatch(name) or not REVISION.fullmatch(revision) or ".." in revision:
        raise ConfigError(
            f"{spec!r} is not a pinned Hub id: write org/name@revision, the revision a commit hash, tag or "
            "branch (e.g. HuggingFaceFW/fineweb-edu@main); a local path may not contain '@'"
        )
    return name, revision


def shared(default: Any, doc: str) -> Any:
    """A field every peer of the run must agree on (part of the fingerprint)."""
    return field(default=default, metadata={"doc": doc, "local": False})


def local(default: Any, doc: str) -> Any:
    """A field that describes one peer's machine; peers may differ."""
    return field(default=default, metadata={"doc": doc, "local": True})


@dataclass(frozen=True)
class RunSection:
    run_id: str = shared("p2p-diloco", "name of the run; peers of one run share it")
    seed: int = shared(0, "seed of theta(0) and of the data order")
    rounds: int = shared(100, "outer rounds in the run; the inner lr schedule spans rounds x H steps")
    dir: str = local("runs/default", "this peer's directory: checkpoints, metrics.jsonl, config.toml")
    device: str = local(
        "auto", "auto (cuda if available, else cpu; a model of 100M parameters or more needs cuda), cpu, cuda or cuda:N"
    )
    eval_every_rounds: int = local(1, "evaluate held-out loss of theta every N rounds (0 = never)")
    eval_sequences: int = local(64, "held-out sequences per evaluation")
    nproc: int = local(
        1,
        "processes this peer trains with, one per GPU (rank r on cuda:r; DDP between them); still one member of "
        "the swarm. Each takes inner.batch_size / nproc sequences of every step",
    )
    fsdp: bool = local(
        False,
        "with run.nproc > 1: shard theta, gradients and AdamW's state across the ranks (FSDP) instead of "
        "copying them to each (DDP): for a model whose training state does not fit one GPU",
    )


@dataclass(frozen=True)
class ModelSection:
    preset: str = shared("150m", "model preset: tiny, small, 150m or 1b (Llama-style)")
    config_path: str = shared("", "a transformers causal-LM config.json (or its folder); overrides preset")
    tokenizer: str = shared(
        "bytes",
        "bytes (byte-level, no download), a tokenizer folder / tokenizer.json, or a Hugging Face Hub id "
        "org/name (downloaded once into the Hub cache), best pinned as org/name@revision (a commit hash)",
    )
    seq_len: int = shared(1024, "tokens per training sequence")


@dataclass(frozen=True)
class DataSection:
    source: Source = shared("stdlib", "stdlib (embedded default corpus), files (local text/jsonl/parquet) or hub")
    path: str = local("", "source=files: a file, a folder or a glob of .txt, .jsonl/.json or .parquet files")
    name: str = shared(
        "",
        "source=hub: dataset name, e.g. allenai/c4 (streamed, never fully downloaded), best pinned as "
        "org/name@revision (a commit hash): every peer then reads the same files",
    )
    subset: str = shared("", "source=hub: dataset configuration, e.g. en")
    text_field: str = shared("text", "column holding the text in jsonl, parquet and hub datasets")
    heldout_fraction: float = shared(
        0.05, "share of documents held out for evaluation (shard_by = file: share of the files, at least one)"
    )
    num_shards: int = shared(64, "the training documents are split into this many disjoint shards")
    shard: int = local(-1, "this peer's shard; -1 picks one from the peer id and seed")
    shard_by: ShardBy = shared(
        "document",
        "document (each document to a random shard: i.i.d. shards; every peer reads the whole corpus), folder "
        "(whole top-level folders per shard: non-i.i.d.; source = stdlib only) or file (whole files per shard, "
        "streamed: a peer reads only its own files; source = files or hub; too few files: by document)",
    )


@dataclass(frozen=True)
class InnerSection:
    steps: int = shared(500, "H: inner AdamW steps per round")
    batch_size: int = shared(512, "sequences per inner step (reached by gradient accumulation)")
    lr: float = shared(4e-4, "peak inner AdamW learning rate")
    weight_decay: float = shared(0.1, "AdamW weight decay")
    beta1: float = shared(0.9, "AdamW beta1")
    beta2: float = shared(0.95, "AdamW beta2")
    warmup_steps: int = shared(1000, "linear warm-up steps, then cosine decay to min_lr_ratio x lr")
    min_lr_ratio: float = shared(0.1, "the cosine schedule ends at this fraction of lr")
    grad_clip: float = shared(1.0, "clip the gradient norm of each inner step to this (0 = off)")
    micro_batch_size: int = local(8, "sequences per forward pass; lower it if you run out of memory")
    precision: Precision = local("auto", "auto (bf16 autocast on CUDA, fp32 on CPU), fp32 or bf16")
    compile: bool = local(
        False,
        "torch.compile the model for the inner steps (evaluation stays eager); the first step compiles "
        "(a minute or more); needs a C++ compiler on the CPU, triton on CUDA",
    )


@dataclass(frozen=True)
class OuterSection:
    lr: float = shared(0.7, "outer SGD learning rate")
    momentum: float = shared(0.9, "outer SGD momentum")
    nesterov: bool = shared(True, "Nesterov momentum (the paper's choice)")
    drop_rate: float = shared(
        0.0,
        "experiments: chance that a peer's pseudo-gradient is left out of a round's "
        "average (it joins with weight 0 and still applies the average)",
    )


@dataclass(frozen=True)
class SwarmSection:
    initial_peers: tuple[str, ...] = local((), "multiaddrs of peers or bootstrap nodes to join; empty = train alone")
    host: str = local("0.0.0.0", "IP address to listen on (127.0.0.1 keeps the peer on this machine)")
    port: int = local(0, "TCP port to listen on; 0 picks a free one")
    announce_host: str = local("", "public IP address to announce, when it differs from host (port forwarding)")
    quic: bool = local(
        False,
        "experimental: also listen on QUIC (UDP, the same port number) besides TCP; peers that both "
        "listen on it connect over QUIC. In the lab 1 of 16 all-reduces over QUIC failed, and the "
        "CPUs were near saturation (docs/benchmarks.md, round trips): keep it off for training",
    )
    identity_path: str = local("", "private key file fixing this peer's id; empty = identity.key in run.dir")
    probe_links: bool = local(
        True,
        "probe the group's peers' links every few rounds (1-8 MiB each, while training) "
        "and announce the figure, so that faster peers reduce larger spans",
    )
    reachability: ReachabilitySetting = local(
        "auto",
        "auto: ask the entry nodes to dial this peer back at start; public: others can dial it (it reduces "
        "and serves); private: behind NAT, it sends and receives through public peers, never reduces",
    )
    upnp: bool = local(False, "ask the home router for a port mapping (UPnP/NAT-PMP; it probes the LAN)")
    hole_punching: bool = local(
        False,
        "libp2p hole punching: public nodes relay, private ones reserve a slot at their relays and "
        "punch direct connections to each other (cone NAT, 4+ public nodes), and reduce for groups "
        "whose every member reached them directly (docs/design.md)",
    )
    relays: tuple[str, ...] = local(
        (),
        "hole punching: the public nodes a private peer holds a relay slot at and others reach it through "
        "(multiaddrs, as initial_peers; every peer of the run gives the same); empty = the initial peers",
    )
    compression: codecs.CodecName = shared(
        codecs.DEFAULT,
        "pseudo-gradient codec on the wire: fp32 (exact), bf16, scaled-fp16, "
        "int8, int4 or int2 (blockwise); norms and biases always travel exact",
    )
    error_feedback: bool = shared(True, "add what the codec failed to send to the next round's pseudo-gradient")
    aggregator: robust.Aggregator = shared(
        "aligned-clip",
        "how a reducer combines its span's parts (docs/design.md: robust averaging): mean, clip "
        "(weights capped, outsized parts clipped), aligned-clip (clip, and parts pointing against the "
        "coordinate-wise median dropped), centered-clip or trimmed-mean",
    )
    clip: float = shared(
        1.0, "clip, aligned-clip and centered-clip: a part counts up to this x the median norm of its span's parts"
    )
    weight_cap: float = shared(2.0, "robust aggregators: a sender's weight counts up to this x the group's median")
    max_reduce_share: float = shared(
        0.5, "no member reduces more than this share of the vector, whatever its measured bandwidth"
    )
    overlap: Overlap = shared(
        "off",
        "off: blocking rounds; delayed or eager: the all-reduce of round r runs during "
        "the inner phase of round r + 1 and its outer update is applied one round late",
    )
    speed_aware: bool = shared(
        True,
        "a round ends when the live peers together trained H x batch tokens each; "
        "off: every peer runs exactly H steps (the paper's setting)",
    )
    claim_cap: float = shared(
        0.0,
        "speed-aware rounds: a peer's progress counts up to this x the round's lower median; 0: 1.4 in open "
        "runs (a liar among four shortens rounds by 9 %), 4.5 in certified ones (a peer 4.5x faster than "
        "the rest ends on budget; a member that lies is named on the dashboard and can be revoked). "
        "docs/design.md §6",
    )
    matchmaking_time_s: float = shared(
        5.0,
        "the slack: how long peers that finished a round wait for the rest of "
        "the group (a complete group starts at once)",
    )
    averaging_timeout_s: float = shared(60.0, "deadline of one all-reduce; a dead or hung peer costs at most this")
    averaging_retries: int = shared(
        1, "after a failed all-reduce, the survivors retry this many times with their kept pseudo-gradients"
    )
    group_size: int = shared(
        16,
        "past 1.5x this many peers at a round, they average in groups of about this size, then across "
        "groups (two levels: docs/design.md §3, 'Past one group'); fewer peers form one group",
    )
    agreement_timeout_s: float = shared(15.0, "how long to wait for the group's digests after the outer step")
    join_timeout_s: float = local(
        30.0,
        "deadline to start or reach the initial peers; the longest silence of a peer serving a state, "
        "and the shortest deadline of a whole state download",
    )
    min_download_mbps: float = local(
        10.0,
        "the slowest download link (Mbit/s) a state download is given time for: its deadline is the "
        "state's size (8 bytes a parameter) at this rate, never under swarm.join_timeout_s",
    )
    linger_s: float = local(
        60.0,
        "after the last round, serve the final state at least this long, for late peers and "
        "`export --initial-peers`; 0 = only while live peers still lack it",
    )


@dataclass(frozen=True)
class AdmissionSection:
    mode: AdmissionMode = shared(
        "open",
        "open: anyone who reaches the swarm may join (demos, friends); certified: only peers holding a "
        "certificate from the organiser (README: Admission)",
    )
    organiser_key: str = shared("", "certified: the organiser's public key, ed25519:... (p2p-diloco admission keygen)")
    certificate: str = local("", "certified: this peer's certificate file from the organiser")
    config_signature: str = local(
        "", "certified: the organiser's signature of this config (p2p-diloco admission sign-config)"
    )


@dataclass(frozen=True)
class CheckpointSection:
    keep: int = local(3, "keep this many latest round checkpoints (a checkpoint is written every round)")


@dataclass(frozen=True)
class LogSection:
    level: LogLevel = local("info", "debug, info, warning or error")
    progress: bool = local(True, "show a live progress bar on the terminal")
    metrics_port: int = local(0, "serve this peer's Prometheus /metrics on log.metrics_host at this port; 0: off")
    metrics_host: str = local("127.0.0.1", "address for log.metrics_port (0.0.0.0: every interface)")
    tensorboard_dir: str = local(
        "",
        "write each round's record as TensorBoard scalars here (relative: in run.dir); empty: off; extra [tensorboard]",
    )
    wandb_project: str = local(
        "", "log each round's record to this Weights & Biases project; empty: off; extra [wandb]"
    )
    wandb_mode: WandbMode = local(
        "online", "online, or offline: the W&B run stays in run.dir/wandb (later: wandb sync)"
    )


@dataclass(frozen=True)
class Config:
    run: RunSection = field(default_factory=RunSection)
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    inner: InnerSection = field(default_factory=InnerSection)
    outer: OuterSection = field(default_factory=OuterSection)
    swarm: SwarmSection = field(default_factory=SwarmSection)
    admission: AdmissionSection = field(default_factory=AdmissionSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    log: LogSection = field(default_factory=LogSection)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {name: _section_dict(getattr(self, name)) for name in SECTIONS}

    def shared_dict(self) -> dict[str, dict[str, Any]]:
        """The fields every peer must share, as plain values."""
        return {
            name: {f.name: value for f, value in _items(getattr(self, name)) if not f.metadata["local"]}
            for name in SECTIONS
        }

    def fingerprint(self) -> str:
        """16 hex digits of sha256 over the shared fields; part of every swarm key (I5)."""
        blob = json.dumps(self.shared_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def replace(self, section: str, **values: Any) -> Config:
        """A copy with some fields of one section changed, validated."""
        new = dataclasses.replace(self, **{section: dataclasses.replace(getattr(self, section), **values)})
        validate(new)
        return new


SECTIONS: dict[str, type] = {f.name: typing.get_type_hints(Config)[f.name] for f in dataclasses.fields(Config)}


def _items(section: Any) -> list[tuple[dataclasses.Field, Any]]:
    return [(f, getattr(section, f.name)) for f in dataclasses.fields(section)]


def _section_dict(section: Any) -> dict[str, Any]:
    return {f.name: list(v) if isinstance(v, tuple) else v for f, v in _items(section)}


def field_specs() -> list[tuple[str, str, type, Any, dict]]:
    """(section, key, type, default, metadata) for every field, in declaration order."""
    specs = []
    for section, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            factory = f.default_factory
            default = factory() if factory is not dataclasses.MISSING else f.default
            specs.append((section, f.name, hints[f.name], default, dict(f.metadata)))
    return specs


def format_value(value: Any) -> str:
    """A value as it is written in run.toml (true, "text", ["a", "b"])."""
    return tomli_w.dumps({"v": list(value) if isinstance(value, tuple) else value})[4:].strip()


def diff_shared(a: Mapping[str, Mapping[str, Any]], b: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Shared fields that differ between two `shared_dict()`s, as 'section.key: a != b' lines."""
    out = []
    for section in sorted(set(a) | set(b)):
        sa, sb = a.get(section, {}), b.get(section, {})
        for key in sorted(set(sa) | set(sb)):
            if sa.get(key) != sb.get(key):
                out.append(f"{section}.{key}: {sa.get(key)!r} != {sb.get(key)!r}")
    return out


# --- parsing ---------------------------------------------------------------------------------


def parse_value(text: str, typ: type, where: str) -> Any:
    """Turn a command-line string into a field's type, or raise ConfigError naming `where`."""
    if typ is bool:
        lowered = text.strip().lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{where} must be true or false, got {text!r}")
    if _is_str_tuple(typ):
        return tuple(part.strip() for part in text.split(",") if part.strip())
    if _is_choice(typ):  # the value is checked against the choices by validate()
        return text
    try:
        return typ(text)
    except ValueError:
        raise ConfigError(f"{where} must be {typ.__name__}, got {text!r}") from None


def _is_str_tuple(typ: Any) -> bool:
    return typing.get_origin(typ) is tuple


def _is_choice(typ: Any) -> bool:
    return typing.get_origin(typ) is Literal


def choices(typ: Any) -> tuple[str, ...]:
    """The values a Literal field takes, or () for any other type."""
    return typing.get_args(typ) if _is_choice(typ) else ()


def _coerce(value: Any, typ: type, where: str) -> Any:
    """Check a TOML value against a field's type (ints are accepted for floats)."""
    if _is_str_tuple(typ):
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{where} must be a list of strings, got {value!r}")
        return tuple(value)
    if _is_choice(typ):
        typ = str  # which string: validate() checks it against the choices
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if typ is int and isinstance(value, bool) or not isinstance(value, typ):
        raise ConfigError(f"{where} must be {typ.__name__}, got {value!r} ({type(value).__name__})")
    return value


RENAMED = {  # keys of earlier versions, and what replaced them
    "client_mode": 'swarm.reachability = "private" (or "auto", the default, which finds out at start)',
    "nat_traversal": "swarm.upnp (port mapping) and swarm.hole_punching (AutoNAT, relays, hole punching)",
}


def _unknown(kind: str, name: str, choices: list[str], where: str) -> ConfigError:
    if name in RENAMED:
        return ConfigError(f"{name!r} in {where} was replaced by {RENAMED[name]}")
    close = difflib.get_close_matches(name, choices, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else f"; valid: {', '.join(choices)}"
    return ConfigError(f"unknown {kind} {name!r} in {where}{hint}")


def from_mapping(data: Mapping[str, Any], where: str = "config") -> Config:
    """Build and validate a Config from nested {section: {key: value}}."""
    sections = {}
    for name, values in data.items():
        if name not in SECTIONS:
            raise _unknown("section", name, list(SECTIONS), where)
        if not isinstance(values, Mapping):
            raise ConfigError(f"[{name}] in {where} must be a table of key = value")
        cls = SECTIONS[name]
        hints = typing.get_type_hints(cls)
        kwargs = {}
        for key, value in values.items():
            if key not in hints:
                raise _unknown(f"key in [{name}]", key, list(hints), where)
            kwargs[key] = _coerce(value, hints[key], f"{name}.{key} in {where}")
        sections[name] = cls(**kwargs)
    config = Config(**sections)
    validate(config)
    return config


def load(path: str | Path | None = None, overrides: Mapping[str, str] | None = None) -> Config:
    """Load a TOML file (or the defaults), apply 'section.key' -> 'value' overrides, validate."""
    data: dict[str, dict[str, Any]] = {}
    where = "defaults"
    if path is not None:
        where = str(path)
        try:
            data = tomllib.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file {path} not found") from None
        except IsADirectoryError:
            raise ConfigError(
                f"config file {path} is a folder, not a file. (docker run -v creates a folder where the file to "
                f"mount did not exist yet: copy run.toml there first, remove the folder, and start again)"
            ) from None
        except PermissionError:
            raise ConfigError(f"config file {path} cannot be read by this user (permission denied)") from None
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"config file {path} is not valid TOML: {e}") from None
    hints = {name: typing.get_type_hints(cls) for name, cls in SECTIONS.items()}
    for dotted, text in (overrides or {}).items():
        section, _, key = dotted.partition(".")
        if section not in SECTIONS:
            raise _unknown("section", section, list(SECTIONS), f"--{dotted}")
        if key not in hints[section]:
            raise _unknown(f"key in [{section}]", key, list(hints[section]), f"--{dotted}")
        data.setdefault(section, {})[key] = parse_value(text, hints[section][key], f"--{dotted}")
    return from_mapping(data, where)


def save(config: Config, path: str | Path, then: str = "") -> None:
    """Write the resolved config as TOML (loadable with `--config`), atomically.

    A failed write (a full disk) leaves no temporary file and raises WriteError, ending with
    `then`: what the caller still has safe.
    """
    path = Path(path)
    tmp = path.with_suffix(path.suffix + ".tmp")
    try:
        tmp.write_text(tomli_w.dumps(config.to_dict()))
        tmp.replace(path)
    except OSError as e:
        raise WriteError.of(path, e, then) from None
    finally:
        with contextlib.suppress(OSError):  # a read-only disk refuses to unlink even a file it never made
            tmp.unlink(missing_ok=True)


# --- validation ------------------------------------------------------------------------------

PRESETS = ("tiny", "small", "150m", "1b")
OVERLAP = typing.get_args(Overlap)
SHARD_BY = typing.get_args(ShardBy)
WANDB_FORBIDDEN = "/\\#?%:"  # characters W&B refuses in a project name


def _require(ok: bool, where: str, problem: str, fix: str) -> None:
    if not ok:
        section, _, key = where.partition(".")
        raise ConfigError(f"{where} {problem}; set [{section}] {key} in run.toml or --{where}=... ({fix})")


def validate(c: Config) -> None:
    """Raise ConfigError on the first invalid field, naming it and the fix."""
    # One section at a time. data.shard_by comes after [inner], where it has always been checked, so
    # a config with several problems keeps reporting the same one first.
    _validate_run(c.run)
    _validate_model(c.model)
    _validate_data(c.data)
    _validate_inner(c.inner)
    rows = c.inner.batch_size // c.run.nproc
    _require(
        c.inner.batch_size % c.run.nproc == 0 and rows % c.inner.micro_batch_size == 0,
        "inner.micro_batch_size",
        f"({c.inner.micro_batch_size}) must divide each rank's share of inner.batch_size "
        f"({c.inner.batch_size} / run.nproc {c.run.nproc})",
        "run.nproc and micro_batch_size powers of two",
    )
    _validate_sharding(c.data)
    _validate_outer(c.outer)
    _validate_swarm(c.swarm)
    _validate_admission(c.admission)
    _require(c.checkpoint.keep >= 1, "checkpoint.keep", f"must be >= 1, got {c.checkpoint.keep}", "e.g. 3")
    _require(
        c.log.level in typing.get_args(LogLevel),
        "log.level",
        f"must be debug, info, warning or error, got {c.log.level!r}",
        "e.g. info",
    )
    port = c.log.metrics_port
    _require(0 <= port <= 65535, "log.metrics_port", f"must be a TCP port or 0 (off), got {port}", "e.g. 9400")
    _validate_sinks(c.log)


def _validate_sinks(log: LogSection) -> None:
    tb, project = log.tensorboard_dir, log.wandb_project
    _require(tb == tb.strip(), "log.tensorboard_dir", f"must not start or end with spaces, got {tb!r}", "e.g. tb")
    _require(
        not set(project) & set(WANDB_FORBIDDEN) and len(project) <= 128 and project == project.strip(),
        "log.wandb_project",
        f"must be a W&B project name (at most 128 characters, none of {WANDB_FORBIDDEN}, no outer spaces), "
        f"got {project!r}",
        "e.g. p2p-diloco; empty: off",
    )
    _require(
        log.wandb_mode in typing.get_args(WandbMode),
        "log.wandb_mode",
        f"must be online or offline, got {log.wandb_mode!r}",
        "offline writes the W&B run to run.dir only",
    )


def _validate_run(r: RunSection) -> None:
    _require(bool(r.run_id.strip()), "run.run_id", "must not be empty", "any name")
    _require(r.rounds >= 1, "run.rounds", f"must be >= 1, got {r.rounds}", "e.g. 100")
    _require(bool(r.dir.strip()), "run.dir", "must not be empty", "a folder path")
    _require(
        _valid_device(r.device),
        "run.device",
        f"must be auto, cpu, cuda or cuda:N, got {r.device!r}",
        "e.g. auto",
    )
    _require(
        r.eval_every_rounds >= 0,
        "run.eval_every_rounds",
        f"must be >= 0, got {r.eval_every_rounds}",
        "0 = never",
    )
    _require(r.eval_sequences >= 1, "run.eval_sequences", f"must be >= 1, got {r.eval_sequences}", "e.g. 64")
    _require(r.nproc >= 1, "run.nproc", f"must be >= 1, got {r.nproc}", "1 per GPU")
    _require(not r.fsdp or r.nproc > 1, "run.fsdp", "shards across ranks, but run.nproc = 1", "--nproc 2 or more")
    _require(
        r.nproc == 1 or r.device in ("auto", "cpu", "cuda"),
        "run.device",
        f"= {r.device} names one GPU, but run.nproc = {r.nproc} trains on {r.nproc} (rank r on cuda:r)",
        "cuda or auto",
    )


def _validate_model(m: ModelSection) -> None:
    _require(
        m.preset in PRESETS or bool(m.config_path),
        "model.preset",
        f"is unknown: {m.preset!r}",
        f"one of {', '.join(PRESETS)}, or set model.config_path",
    )
    _require(m.seq_len >= 2, "model.seq_len", f"must be >= 2, got {m.seq_len}", "e.g. 1024")
    _require_hub_spec(m.tokenizer, "model.tokenizer")


def _require_hub_spec(spec: str, where: str) -> None:
    try:
        hub_spec(spec)
    except ConfigError as e:
        _require(False, where, f"= {e}", "or leave the revision out: the Hub's latest")


def _validate_data(d: DataSection) -> None:
    _require(
        d.source in typing.get_args(Source),
        "data.source",
        f"must be stdlib, files or hub, got {d.source!r}",
        "stdlib needs nothing",
    )
    _require(
        d.source != "files" or bool(d.path),
        "data.path",
        "is required when data.source = files",
        "a file, folder or glob",
    )
    _require(
        d.source != "hub" or bool(d.name),
        "data.name",
        "is required when data.source = hub",
        "e.g. allenai/c4",
    )
    _require(
        0.0 < d.heldout_fraction < 1.0,
        "data.heldout_fraction",
        f"must be in (0, 1), got {d.heldout_fraction}",
        "e.g. 0.05",
    )
    _require(d.num_shards >= 1, "data.num_shards", f"must be >= 1, got {d.num_shards}", "e.g. 64")
    _require(
        -1 <= d.shard < d.num_shards,
        "data.shard",
        f"must be -1 or in [0, {d.num_shards}), got {d.shard}",
        "-1 picks one for you",
    )
    _require(bool(d.text_field), "data.text_field", "must not be empty", "e.g. text")
    if d.source == "hub":
        _require_hub_spec(d.name, "data.name")


def _validate_sharding(d: DataSection) -> None:
    _require(
        d.shard_by in SHARD_BY,
        "data.shard_by",
        f"must be one of {', '.join(SHARD_BY)}, got {d.shard_by!r}",
        "document is the default",
    )
    _require(
        d.shard_by != "folder" or d.source == "stdlib",
        "data.shard_by",
        f"= folder needs a corpus with folders (source = stdlib), got source = {d.source}",
        "use document",
    )
    _require(
        d.shard_by != "file" or d.source in ("files", "hub"),
        "data.shard_by",
        f"= file needs a corpus of files (source = files or hub), got source = {d.source}",
        "use document",
    )


def _validate_outer(o: OuterSection) -> None:
    _require(
        0.0 <= o.drop_rate < 1.0,
        "outer.drop_rate",
        f"must be in [0, 1), got {o.drop_rate}",
        "0 = never; the paper tries 0.1 to 0.5",
    )
    _require(_pos(o.lr), "outer.lr", f"must be > 0, got {o.lr}", "the paper uses 0.7")
    _require(
        0.0 <= o.momentum < 1.0,
        "outer.momentum",
        f"must be in [0, 1), got {o.momentum}",
        "the paper uses 0.9",
    )


def _validate_inner(i: InnerSection) -> None:
    _require(i.steps >= 1, "inner.steps", f"must be >= 1, got {i.steps}", "the paper uses H = 500")
    _require(i.batch_size >= 1, "inner.batch_size", f"must be >= 1, got {i.batch_size}", "e.g. 512")
    _require(_pos(i.lr), "inner.lr", f"must be > 0, got {i.lr}", "the paper uses 4e-4")
    _require(
        i.weight_decay >= 0 and math.isfinite(i.weight_decay),
        "inner.weight_decay",
        f"must be >= 0, got {i.weight_decay}",
        "e.g. 0.1",
    )
    _require(0.0 <= i.beta1 < 1.0, "inner.beta1", f"must be in [0, 1), got {i.beta1}", "e.g. 0.9")
    _require(0.0 <= i.beta2 < 1.0, "inner.beta2", f"must be in [0, 1), got {i.beta2}", "e.g. 0.95")
    _require(i.warmup_steps >= 0, "inner.warmup_steps", f"must be >= 0, got {i.warmup_steps}", "e.g. 1000")
    _require(0.0 <= i.min_lr_ratio <= 1.0, "inner.min_lr_ratio", f"must be in [0, 1], got {i.min_lr_ratio}", "e.g. 0.1")
    _require(
        i.grad_clip >= 0 and math.isfinite(i.grad_clip),
        "inner.grad_clip",
        f"must be >= 0, got {i.grad_clip}",
        "0 = off",
    )
    _require(i.micro_batch_size >= 1, "inner.micro_batch_size", f"must be >= 1, got {i.micro_batch_size}", "e.g. 8")
    _require(
        i.batch_size % i.micro_batch_size == 0,
        "inner.micro_batch_size",
        f"({i.micro_batch_size}) must divide inner.batch_size ({i.batch_size})",
        "e.g. a power of two",
    )
    _require(
        i.precision in typing.get_args(Precision),
        "inner.precision",
        f"must be auto, fp32 or bf16, got {i.precision!r}",
        "auto",
    )


def _validate_admission(a: AdmissionSection) -> None:
    _require(
        a.mode in typing.get_args(AdmissionMode),
        "admission.mode",
        f"must be open or certified, got {a.mode!r}",
        "open admits anyone",
    )
    _require(
        a.mode == "open" or bool(a.organiser_key),
        "admission.organiser_key",
        "is required when admission.mode = certified",
        "the line `p2p-diloco admission keygen` printed",
    )
    if a.organiser_key:
        from p2p_diloco.trust import admission  # the key's format lives with the certificates

        try:
            admission.parse_public_key(a.organiser_key)
        except P2PDilocoError as e:
            raise ConfigError(f"{e}; set [admission] organiser_key in run.toml") from None


def _validate_swarm(s: SwarmSection) -> None:
    _require(0 <= s.port <= 65535, "swarm.port", f"must be in [0, 65535], got {s.port}", "0 picks a free port")
    _require(
        s.compression in codecs.CODECS,
        "swarm.compression",
        f"must be one of {', '.join(codecs.CODECS)}, got {s.compression!r}",
        f"{codecs.DEFAULT} is the default",
    )
    _require(
        s.overlap in OVERLAP,
        "swarm.overlap",
        f"must be one of {', '.join(OVERLAP)}, got {s.overlap!r}",
        "off blocks each round on its all-reduce",
    )
    _require(
        s.reachability in typing.get_args(ReachabilitySetting),
        "swarm.reachability",
        f"must be one of {', '.join(typing.get_args(ReachabilitySetting))}, got {s.reachability!r}",
        "auto finds out at start whether others can dial this peer",
    )
    _require(
        s.aggregator in robust.AGGREGATORS,
        "swarm.aggregator",
        f"must be one of {', '.join(robust.AGGREGATORS)}, got {s.aggregator!r}",
        "aligned-clip is the default",
    )
    for name in ("clip", "weight_cap"):
        value = getattr(s, name)
        _require(math.isfinite(value) and value >= 1, f"swarm.{name}", f"must be >= 1, got {value}", "e.g. 2")
    _require(
        s.claim_cap == 0 or (math.isfinite(s.claim_cap) and s.claim_cap >= 1),
        "swarm.claim_cap",
        f"must be 0 (by admission.mode) or >= 1, got {s.claim_cap}",
        "e.g. 2",
    )
    _require(
        0 < s.max_reduce_share <= 1,
        "swarm.max_reduce_share",
        f"must be in (0, 1], got {s.max_reduce_share}",
        "1 lets the fastest peer reduce everything",
    )
    _require(2 <= s.group_size <= 1024, "swarm.group_size", f"must be in [2, 1024], got {s.group_size}", "e.g. 16")
    _require(
        0 <= s.averaging_retries <= 10,
        "swarm.averaging_retries",
        f"must be in [0, 10], got {s.averaging_retries}",
        "e.g. 1",
    )
    _validate_waits(s)


def _validate_waits(s: SwarmSection) -> None:
    """The swarm's deadlines and what they are derived from (I3)."""
    for name in ("matchmaking_time_s", "averaging_timeout_s", "agreement_timeout_s", "join_timeout_s"):
        value = getattr(s, name)
        _require(_pos(value), f"swarm.{name}", f"must be > 0 seconds, got {value}", "every network wait has a deadline")
    _require(
        _pos(s.min_download_mbps),
        "swarm.min_download_mbps",
        f"must be > 0, got {s.min_download_mbps}",
        "e.g. 10 for a home link",
    )
    _require(
        math.isfinite(s.linger_s) and s.linger_s >= 0,
        "swarm.linger_s",
        f"must be >= 0 seconds, got {s.linger_s}",
        "e.g. 60",
    )


def _pos(x: float) -> bool:
    return math.isfinite(x) and x > 0


def _valid_device(device: str) -> bool:
    if device in ("auto", "cpu", "cuda"):
        return True
    prefix, _, index = device.partition(":")
    return prefix == "cuda" and index.isdigit()
