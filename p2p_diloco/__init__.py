"""p2p-diloco: peer-to-peer, serverless DiLoCo training of language models."""

from importlib import metadata

try:
    __version__ = metadata.version("p2p-diloco")
except metadata.PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "unknown"
