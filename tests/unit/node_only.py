"""`p2p-diloco` as the node-only image installs it (bootstrap/Dockerfile): the command line, with
the training stack (transformers, datasets, safetensors) impossible to import. Run as a script."""

import importlib.abc
import sys

TRAINING_STACK = ("transformers", "datasets", "safetensors")


class NoTrainingStack(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in TRAINING_STACK:
            raise ModuleNotFoundError(f"No module named {name!r} (node-only install)", name=name)
        return None


if __name__ == "__main__":
    sys.meta_path.insert(0, NoTrainingStack())
    from p2p_diloco.cli import main

    sys.exit(main(sys.argv[1:]))
