"""A seconds-long version of bench/convergence.py: DiLoCo with 2 real peers against data-parallel
with 2 gloo workers (`p2p-diloco baseline`), same model, data, schedule and tokens. Asserts only
what holds at this size: the same start, the same tokens, both learn, exact communication volumes,
and DiLoCo sending at least H times less. Which one ends lower is the benchmark's question."""

import json
import subprocess

import pytest

from tests.swarm.conftest import CLI, ENV, SWARM, wait_until

H, ROUNDS, WORKERS = 5, 4, 2
SETTING = {
    **SWARM,
    "inner.steps": str(H),
    "run.rounds": str(ROUNDS),
    "data.num_shards": str(WORKERS),
    "run.eval_sequences": "16",
    "swarm.speed_aware": "false",
}
TINY_PARAMETERS = (
    469_632  # model.count_parameters of the tiny preset with the byte tokenizer (tests/unit/test_model.py)
)


@pytest.mark.scenario  # bench/convergence.py measures the claim itself
@pytest.mark.timeout(240)
def test_diloco_against_data_parallel_smoke(swarm, tmp_path):
    dp_dir = tmp_path / "dp"
    options = [f"--{k}={v}" for k, v in {**SETTING, "run.dir": str(dp_dir)}.items() if not k.startswith("swarm.")]
    with open(tmp_path / "dp.log", "w") as log:
        dp = subprocess.Popen(
            [*CLI, "baseline", "--workers", str(WORKERS), *options],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=ENV,
            start_new_session=True,
        )
    swarm.procs.append(dp)
    swarm.sessions.add(dp.pid)
    peers = [swarm.peer(f"p{i}", {**SETTING, "data.shard": str(i)}) for i in range(WORKERS)]
    everyone = [dp, *peers]
    wait_until(lambda: all(p.poll() is not None for p in everyone), everyone, 200, "both runs finish")
    assert [p.returncode for p in everyone] == [0] * len(everyone), (tmp_path / "dp.log").read_text()[-2000:]

    dp_records = [json.loads(line) for line in (dp_dir / "metrics.jsonl").read_text().splitlines()]
    peer_records = [swarm.records(f"p{i}") for i in range(WORKERS)]
    start, dp_end = dp_records[0], dp_records[-1]
    diloco_end = peer_records[0][ROUNDS]
    assert len({rec[ROUNDS]["digest"] for rec in peer_records}) == 1
    assert [rec[r]["group_size"] for rec in peer_records for r in range(2, ROUNDS + 1)] == [WORKERS] * (
        ROUNDS - 1
    ) * WORKERS

    # The same θ(0) on the same held-out sequences, and the same tokens in all.
    assert start["eval_loss"] == peer_records[0][0]["eval_loss"]
    assert dp_end["step"] == ROUNDS * H and [r["step"] for r in dp_records] == [r * H for r in range(ROUNDS + 1)]
    tokens = ROUNDS * H * 4 * 32 * WORKERS  # steps x batch x seq_len x workers
    assert dp_end["total_tokens"] == sum(rec[ROUNDS]["total_tokens"] for rec in peer_records) == tokens
    # Both learn.
    assert dp_end["eval_loss"] < start["eval_loss"] - 0.5
    assert diloco_end["eval_loss"] < start["eval_loss"] - 0.5
    # Data-parallel all-reduces every fp32 gradient every step: 2(k-1)/k x 4 bytes x parameters per step.
    assert dp_end["bytes_sent"] == ROUNDS * H * TINY_PARAMETERS * 4 * 2 * (WORKERS - 1) // WORKERS
    diloco_bytes = max(sum(rec[r]["bytes_sent"] for r in range(1, ROUNDS + 1)) for rec in peer_records)
    assert 0 < diloco_bytes * H <= dp_end["bytes_sent"]
