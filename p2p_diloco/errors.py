"""The package's exceptions. Each message names the problem and, where there is one, the fix."""


class P2PDilocoError(Exception):
    """Base class: the CLI prints these as one line and exits non-zero."""

    exit_code = 1


class ConfigError(P2PDilocoError):
    """A config file, override or CLI argument is invalid."""

    exit_code = 2


class DataError(P2PDilocoError):
    """A corpus cannot be found, read or split."""


class ModelError(P2PDilocoError):
    """An unknown preset, an unreadable model config or tokenizer."""


class CheckpointError(P2PDilocoError):
    """A checkpoint is missing, truncated, corrupt or from another run."""


class PseudoGradError(P2PDilocoError):
    """A pseudo-gradient failed its local checks (not finite, implausibly large)."""


class SwarmError(P2PDilocoError):
    """The swarm cannot be joined or served: addresses, ports, identity, peers, another run config."""


class RunConfigMismatch(SwarmError):
    """The run's peers hold another config (I5): a config problem, so the exit code of one."""

    exit_code = 2


class AveragingError(P2PDilocoError):
    """A round's all-reduce failed or was incomplete; nothing of it was applied (I2)."""


class StateDownloadError(P2PDilocoError):
    """No peer served a state that matches the digest the swarm published."""


class AdmissionError(P2PDilocoError):
    """A run key, certificate or admission setting is missing, malformed or does not admit this peer."""

    exit_code = 2
