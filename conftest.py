"""Loaded by pytest before any test module imports torch.

The README's install skips byte-compiling (`pip install --no-compile`: pip compiles every module of
torch and its company, about 70 s of the test command's 20 minutes on 2 cores). Python then
compiles a module when it is first imported, and writes it to __pycache__ for the next process,
unless told not to: the suite's many processes would compile torch again, each. So the suite
writes what it imports once, even where the machine's environment says not to
(PYTHONDONTWRITEBYTECODE, set on CI's machines), in the virtual environment and this checkout only.

The processes the tests start put their temporary files (p2pd's sockets, multiprocessing's and
torch's folders) in a folder of this session's (their TMPDIR), removed when the session ends: a
peer a test SIGKILLs leaves them behind, and they would pile up in /tmp. The suite's own process
keeps the machine's temporary folder (pytest's tmp_path stays where it was).
"""

import atexit
import os
import shutil
import sys
import tempfile

sys.dont_write_bytecode = False
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)  # for the processes the tests start

CHILDREN_TMP = tempfile.mkdtemp(prefix="p2pt-")  # fixes this process's tempfile.tempdir first
os.environ["TMPDIR"] = CHILDREN_TMP
atexit.register(shutil.rmtree, CHILDREN_TMP, ignore_errors=True)
