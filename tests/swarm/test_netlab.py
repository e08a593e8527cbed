"""The emulated links of bench/netlab.py: the rates `tc` was given are the rates TCP gets, and the
lab leaves no namespace or process behind, also when the code inside it fails."""

import subprocess
import sys

import pytest

from bench.netlab import NetLab, available, measure_tcp, namespaces

pytestmark = pytest.mark.skipif(available() is not None, reason=f"no network lab here: {available()}")

# TCP payload per byte tbf counts: a 1514-byte frame (14 Ethernet + 20 IP + 32 TCP with
# timestamps) carries 1448 bytes.
GOODPUT = 1448 / 1514


@pytest.mark.timeout(60)
def test_tcp_gets_the_rate_set_on_each_host_link():
    with NetLab([(20, 20), (20, 20), (5, 20)]) as lab:
        prefix = lab.prefix
        both_fast = measure_tcp(lab, 0, 1, seconds=1.5)
        slow_upload = measure_tcp(lab, 2, 0, seconds=1.5)
    assert both_fast == pytest.approx(20 * GOODPUT, rel=0.15)  # 19.1 Mbit/s
    assert slow_upload == pytest.approx(5 * GOODPUT, rel=0.15)  # 4.8 Mbit/s: the sender's upload limits
    assert namespaces(prefix) == []


@pytest.mark.timeout(60)
def test_an_error_inside_the_lab_still_ends_its_processes_and_namespaces():
    with pytest.raises(ZeroDivisionError):
        with NetLab([(10, 10), (10, 10)]) as lab:
            prefix = lab.prefix
            waiting = lab.popen(0, [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
            assert sorted(namespaces(prefix)) == [f"{prefix}br", f"{prefix}h0", f"{prefix}h1"]
            raise ZeroDivisionError("an error inside the lab")
    assert waiting.poll() is not None, "a process started in the lab outlived it"
    assert namespaces(prefix) == []
