"""Loaded by pytest before any test module imports torch.

The README's install skips byte-compiling (`pip install --no-compile`: pip compiles every module of
torch and its company, about 70 s of the test command's 20 minutes on 2 cores). Python then
compiles a module when it is first imported, and writes it to __pycache__ for the next process,
unless told not to: the suite's many processes would compile torch again, each. So the suite
writes what it imports once, even where the machine's environment says not to
(PYTHONDONTWRITEBYTECODE, set on CI's machines), in the virtual environment and this checkout only.
"""

import os
import sys

sys.dont_write_bytecode = False
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)  # for the processes the tests start
